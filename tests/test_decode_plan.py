"""The flat decode loop computes exactly what the model's forward computes (bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.cpu_attention import default_attention_backend
from tokenmill.layers.quantized import QuantizedLinear
from tokenmill.models.decode_plan import DecodePlan
from tokenmill.models.loader import load_model
from tokenmill.worker.forward_input import ForwardInput
from tokenmill.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not DecodePlan.applies(default_attention_backend(torch.device("cpu"), torch.bfloat16, 64, 1)),
    reason="the decode plan runs on the CPU kernels (AVX-512, or the AVX2 build)")

PROMPTS = [[5, 9, 200, 31, 7], [1000, 4, 4, 17, 300, 12, 9, 8, 2000], [42] * 20]


def _runner(model_dir, quantization: str | None) -> ModelRunner:
    loaded = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"), quantization=quantization,
                        with_tokenizer=False)
    return ModelRunner(loaded.model, num_blocks=8, block_size=16, device=torch.device("cpu"), dtype=torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_plan_equals_the_models_forward(tiny_model_dirs, arch, quantization, monkeypatch):
    runner = _runner(tiny_model_dirs[arch], quantization)
    assert runner.decode_plan is not None
    if quantization == "int4":  # bound as bare kernel calls: VNNI's interleaved layout, or quant_gemv_i8 (AVX2)
        layer = runner.model.layers[0].mlp.down_proj
        assert isinstance(layer, QuantizedLinear) and layer.few_row_kernel() is not None
    calls = []
    plan_forward = DecodePlan.forward
    monkeypatch.setattr(DecodePlan, "forward", lambda self, *a: calls.append(1) or plan_forward(self, *a))

    tables = [[0], [1], [2, 3]]
    runner.forward(ForwardInput(PROMPTS, [0, 0, 0], tables, [True] * 3))  # prefill: the model's forward
    assert not calls
    lengths = [len(p) for p in PROMPTS]
    plan = runner.decode_plan
    for step, tokens in enumerate([[11, 12, 13], [7, 8, 9], [300, 1, 2]]):
        batch = ForwardInput([[t] for t in tokens], [n + step for n in lengths], tables, [True] * 3)
        with_plan = runner.forward(batch)
        runner.decode_plan = None  # rewrites the same cache slots with the same values
        without = runner.forward(batch)
        runner.decode_plan = plan
        assert torch.equal(with_plan, without), f"step {step}: max diff {(with_plan - without).abs().max()}"
    assert len(calls) == 3


def test_plan_takes_only_few_row_decode_steps(tiny_llama_dir):
    runner = _runner(tiny_llama_dir, "int4")
    metadata = runner.backend.build_metadata
    geometry = runner.geometry
    decode = metadata([1] * 8, [4] * 8, [[i] for i in range(8)], geometry)
    wide = metadata([1] * 9, [4] * 9, [[i % 8] for i in range(9)], geometry)
    mixed = metadata([3, 1], [0, 4], [[0], [1]], geometry)

    def covers(md, num_tokens):
        return DecodePlan.covers(torch.zeros(num_tokens, dtype=torch.int64), type("Ctx", (), {"metadata": md}))

    assert covers(decode, 8)
    assert not covers(wide, 9)  # the batched path: the modules' own choice
    assert not covers(mixed, 4)
