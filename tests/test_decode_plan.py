"""The flat decode loop computes exactly what the model's forward computes (bit for bit)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.cpu_attention import default_attention_backend
from tokenmill.layers.cpu_kernels import decode_attention_rows_available, quant_gemv_q8_available
from tokenmill.layers.quantized import InterleavedWeight, QuantizedLinear, quantize_rtn
from tokenmill.models import decode_plan
from tokenmill.models.decode_plan import DecodePlan, FusedLayers
from tokenmill.models.loader import load_model
from tokenmill.worker.forward_input import ForwardInput
from tokenmill.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not DecodePlan.applies(default_attention_backend(torch.device("cpu"), torch.bfloat16, 64, 1)),
    reason="the decode plan runs on the CPU kernels (AVX-512, or the AVX2 build)")

PROMPTS = [[5, 9, 200, 31, 7], [1000, 4, 4, 17, 300, 12, 9, 8, 2000], [42] * 20]


def _runner(model_dir, quantization: str | None) -> ModelRunner:
    loaded = load_model(str(model_dir), torch.bfloat16, torch.device("cpu"), quantization=quantization,
                        tokenizer="none")
    return ModelRunner(loaded.model, num_blocks=8, block_size=16, device=torch.device("cpu"), dtype=torch.bfloat16)


def _float32_runner(model_dir, quantization: str, kv_cache_dtype: torch.dtype) -> ModelRunner:
    loaded = load_model(str(model_dir), torch.float32, torch.device("cpu"), quantization=quantization,
                        tokenizer="none")
    return ModelRunner(loaded.model, num_blocks=32, block_size=16, device=torch.device("cpu"), dtype=torch.float32,
                       kv_cache_dtype=kv_cache_dtype)


def _with_and_without(runner: ModelRunner, batch: ForwardInput, owner: object, name: str):
    """runner.forward(batch) with owner.name as it is, then with it None (the second forward
    rewrites the same cache slots with the same values)."""
    kept = getattr(owner, name)
    with_it = runner.forward(batch)
    setattr(owner, name, None)
    try:
        return with_it, runner.forward(batch)
    finally:
        setattr(owner, name, kept)


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
    for step, tokens in enumerate([[11, 12, 13], [7, 8, 9], [300, 1, 2]]):
        batch = ForwardInput([[t] for t in tokens], [n + step for n in lengths], tables, [True] * 3)
        with_plan, without = _with_and_without(runner, batch, runner, "decode_plan")
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


def _decode_steps(runner: ModelRunner, prompts: list[list[int]], num_steps: int) -> list[ForwardInput]:
    """Prefill the prompts (one block table each, 4 blocks apart), then num_steps decode batches."""
    tables = [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(len(prompts))]
    runner.forward(ForwardInput(prompts, [0] * len(prompts), tables, [True] * len(prompts)))
    return [ForwardInput([[(7 * i + 3 * step) % 500 + 1] for i in range(len(prompts))],
                         [len(p) + step for p in prompts], tables, [True] * len(prompts)) for step in range(num_steps)]


def _assert_fused_equals_the_loop(runner: ModelRunner, attribute: str, prompts: list[list[int]], num_steps: int,
                                  monkeypatch) -> None:
    """Each of num_steps decode steps after the prompts: the plan's fused layers (plan.<attribute>,
    DecodeLayers or DecodeLayersRows) give the Python loop's hidden states bit for bit, and they
    really ran, once a step."""
    fused_calls = []
    fused_call = FusedLayers.__call__
    monkeypatch.setattr(FusedLayers, "__call__", lambda self, *a: fused_calls.append(1) or fused_call(self, *a))
    for step, batch in enumerate(_decode_steps(runner, prompts, num_steps)):
        with_fused, loop = _with_and_without(runner, batch, runner.decode_plan, attribute)
        assert torch.equal(with_fused, loop), f"step {step}: max diff {(with_fused - loop).abs().max()}"
    assert len(fused_calls) == num_steps


@pytest.mark.skipif(not quant_gemv_q8_available(), reason="DecodeLayers runs the VNNI kernel (AVX-512 VNNI)")
@pytest.mark.parametrize("quantization", ["int4", "int8"])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])  # 8: two passes of 4 activation rows over each block
def test_fused_layers_equal_the_plans_loop(tiny_llama_dir, quantization, num_seqs, monkeypatch):
    """DecodeLayers (one call for every layer) gives the Python loop's hidden states bit for bit,
    over contexts that cross block boundaries (prompts of 5 to 40 tokens, 8 steps)."""
    runner = ModelRunner(load_model(str(tiny_llama_dir), torch.bfloat16, torch.device("cpu"), quantization=quantization,
                                    tokenizer="none").model,
                         num_blocks=32, block_size=16, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert runner.decode_plan is not None and runner.decode_plan.fused is not None
    prompts = [[(31 * i + j) % 900 + 1 for j in range(5 + 5 * i)] for i in range(num_seqs)]
    _assert_fused_equals_the_loop(runner, "fused", prompts, 8, monkeypatch)


def _with_quantized_head(model, interleaved: bool, activation_bits: int):
    """model with its dense head quantized (8 bits, groups of 32: the default model's tied Q8_0 table)."""
    head = QuantizedLinear(quantize_rtn(model.lm_head.weight.data.float(), 8, 32))
    if interleaved:
        head.qweight = InterleavedWeight.from_rows(head.qweight)
    head.activation_bits = activation_bits
    model.lm_head = head
    return model


@pytest.mark.skipif(not quant_gemv_q8_available(), reason="DecodeLayers runs the VNNI kernel (AVX-512 VNNI)")
@pytest.mark.parametrize("activation_bits", [16, 8])
@pytest.mark.parametrize("num_seqs", [1, 5])
def test_fused_layers_multiply_a_quantized_head_too(tiny_llama_dir, activation_bits, num_seqs, monkeypatch):
    """Where the head runs the VNNI kernel, DecodeLayers returns the logits: compute_logits of the
    loop's hidden states, bit for bit."""
    model = load_model(str(tiny_llama_dir), torch.bfloat16, torch.device("cpu"), quantization="int4",
                       tokenizer="none").model
    runner = ModelRunner(_with_quantized_head(model, True, activation_bits), num_blocks=32, block_size=16,
                         device=torch.device("cpu"), dtype=torch.bfloat16)
    assert runner.decode_plan.fused.gives_logits
    prompts = [[(13 * i + j) % 800 + 1 for j in range(7 + 6 * i)] for i in range(num_seqs)]
    _assert_fused_equals_the_loop(runner, "fused", prompts, 4, monkeypatch)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_layers_with_biases_or_qk_norms_keep_the_loop(tiny_model_dirs, arch):
    runner = _runner(tiny_model_dirs[arch], "int4")
    assert runner.decode_plan is not None and runner.decode_plan.fused is None
    float32_runner = _float32_runner(tiny_model_dirs[arch], "int4", torch.float32)
    assert float32_runner.decode_plan is not None and float32_runner.decode_plan.fused_rows is None


@pytest.mark.skipif(not quant_gemv_q8_available(), reason="DecodeLayers runs the VNNI kernel (AVX-512 VNNI)")
def test_fused_layers_with_mixed_layouts(tiny_llama_dir, monkeypatch):
    """Projections of different bits, group sizes and activation bits in one model (as Q4_K_M
    files mix them): still the Python loop's result bit for bit."""
    model = load_model(str(tiny_llama_dir), torch.bfloat16, torch.device("cpu"), quantization="int4",
                       tokenizer="none").model
    for layer, bits, group in ((model.layers[0].mlp.down_proj, 8, 16), (model.layers[1].self_attn.qkv_proj, 8, 32),
                               (model.layers[1].mlp.gate_up_proj, 4, 64)):
        layer.qweight = InterleavedWeight.from_rows(quantize_rtn(layer.qweight.dequantize(), bits, group))
    model.layers[0].self_attn.o_proj.activation_bits = 8  # one 8-bit part
    runner = ModelRunner(model, num_blocks=32, block_size=16, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert runner.decode_plan.fused is not None
    prompts = [[(17 * i + j) % 700 + 1 for j in range(9 + 7 * i)] for i in range(5)]
    _assert_fused_equals_the_loop(runner, "fused", prompts, 4, monkeypatch)


@pytest.mark.skipif(not decode_attention_rows_available(), reason="the AVX2 build's op")
@pytest.mark.parametrize("kv_cache_dtype", [torch.float32, torch.float16])
def test_the_avx2_plans_attention_is_one_op_bit_for_bit(tiny_llama_dir, kv_cache_dtype, monkeypatch):
    """On the AVX2 build a layer's rotary, KV write and decode attention are one op
    (fused_decode_attention_rows): the model's forward, which runs them one by one, bit for bit,
    for a float32 model with its own pool or a float16 one. (The plan's Python loop, which layers
    DecodeLayersRows does not take run; here it is made to run by TOKENMILL_DECODE_LAYERS=0.)"""
    monkeypatch.setenv("TOKENMILL_DECODE_LAYERS", "0")
    loaded = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int4",
                        tokenizer="none")
    runner = ModelRunner(loaded.model, num_blocks=8, block_size=16, device=torch.device("cpu"), dtype=torch.float32,
                         kv_cache_dtype=kv_cache_dtype)
    calls = []
    fused = decode_plan.fused_decode_attention_rows
    monkeypatch.setattr(decode_plan, "fused_decode_attention_rows", lambda *a: calls.append(1) or fused(*a))
    tables = [[0], [1], [2, 3]]
    runner.forward(ForwardInput(PROMPTS, [0, 0, 0], tables, [True] * 3))
    lengths = [len(p) for p in PROMPTS]
    for step, tokens in enumerate([[11, 12, 13], [7, 8, 9], [300, 1, 2]]):
        batch = ForwardInput([[t] for t in tokens], [n + step for n in lengths], tables, [True] * 3)
        with_plan, without = _with_and_without(runner, batch, runner, "decode_plan")
        assert torch.equal(with_plan, without), f"step {step}: max diff {(with_plan - without).abs().max()}"
    assert len(calls) == 3 * len(runner.model.layers)


@pytest.mark.skipif(not decode_attention_rows_available(), reason="DecodeLayersRows is the AVX2 build's")
@pytest.mark.parametrize("quantization,kv_cache_dtype", [("int4", torch.float32), ("int4", torch.float16),
                                                         ("int8", torch.bfloat16)])
@pytest.mark.parametrize("num_seqs", [1, 3, 8])  # 8: two passes of 4 activation rows over the weights
def test_fused_row_layers_equal_the_plans_loop(tiny_llama_dir, quantization, kv_cache_dtype, num_seqs, monkeypatch):
    """On the AVX2 build, DecodeLayersRows (one call for every layer) gives the Python loop's hidden
    states bit for bit, over contexts that cross block boundaries (prompts of 5 to 40 tokens, 8
    steps), with the model's own float32 pool or a 16-bit one."""
    runner = _float32_runner(tiny_llama_dir, quantization, kv_cache_dtype)
    plan = runner.decode_plan
    assert plan is not None and plan.fused_rows is not None and plan.fused is None
    prompts = [[(31 * i + j) % 900 + 1 for j in range(5 + 5 * i)] for i in range(num_seqs)]
    _assert_fused_equals_the_loop(runner, "fused_rows", prompts, 8, monkeypatch)


@pytest.mark.skipif(not decode_attention_rows_available(), reason="DecodeLayersRows is the AVX2 build's")
def test_fused_row_layers_with_mixed_layouts(tiny_llama_dir, monkeypatch):
    """Projections of different bits, group sizes and activation bits in one float32 model (as
    Q4_K_M files mix them): still the Python loop's result bit for bit; a projection with a bias
    keeps the loop."""
    model = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int4",
                       tokenizer="none").model
    for layer, bits, group in ((model.layers[0].mlp.down_proj, 8, 32), (model.layers[1].self_attn.qkv_proj, 8, 32),
                               (model.layers[1].mlp.gate_up_proj, 4, 64)):
        layer.qweight = quantize_rtn(layer.qweight.dequantize(), bits, group)
    model.layers[0].self_attn.o_proj.activation_bits = 8  # one 8-bit part
    runner = ModelRunner(model, num_blocks=32, block_size=16, device=torch.device("cpu"), dtype=torch.float32)
    assert runner.decode_plan.fused_rows is not None
    prompts = [[(17 * i + j) % 700 + 1 for j in range(9 + 7 * i)] for i in range(5)]
    _assert_fused_equals_the_loop(runner, "fused_rows", prompts, 4, monkeypatch)
    model.layers[1].mlp.down_proj.bias = torch.zeros(model.layers[1].mlp.down_proj.out_features)
    assert DecodePlan(model, runner.kv_caches).fused_rows is None


@pytest.mark.skipif(not decode_attention_rows_available(), reason="DecodeLayersRows is the AVX2 build's")
@pytest.mark.parametrize("num_seqs", [1, 5])
def test_fused_row_layers_multiply_a_quantized_head_too(tiny_llama_dir, num_seqs, monkeypatch):
    """Where the head runs quant_gemv_i8, DecodeLayersRows returns the logits: compute_logits of the
    loop's hidden states, bit for bit."""
    model = load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int4",
                       tokenizer="none").model
    runner = ModelRunner(_with_quantized_head(model, False, 16), num_blocks=32, block_size=16,
                         device=torch.device("cpu"), dtype=torch.float32)
    assert runner.decode_plan.fused_rows.gives_logits
    prompts = [[(13 * i + j) % 800 + 1 for j in range(7 + 6 * i)] for i in range(num_seqs)]
    _assert_fused_equals_the_loop(runner, "fused_rows", prompts, 4, monkeypatch)
