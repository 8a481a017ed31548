"""The engine on a CUDA device (skipped where there is none): tiny models against HF on the same GPU."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import TorchPagedAttention
from tokenmill.layers.gpu_quantized import DequantizedLinear, Int4TinyGemmLinear, tinygemm_inner_k_tiles

from conftest import TINY_ARCHS
from test_gpu_quantized import random_weight

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["The quick brown fox", "In the beginning there was only the sea, and the sea was", "A"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_on_cuda(arch, tiny_model_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dirs[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(model=str(path), dtype="float32", device="cuda", num_kv_blocks=128)
    assert llm.engine.device.type == "cuda" and type(llm.engine.executor.runner.backend) is TorchPagedAttention
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to("cuda")
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              pad_token_id=0)[0, ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == ref


def test_batching_preemption_and_seeds_on_cuda(tiny_llama_dir):
    roomy = LLM(model=str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=128)
    alone = [roomy.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS * 2]
    tight = LLM(model=str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=8, max_num_batched_tokens=9)
    together = tight.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == alone
    assert tight.stats().kv_cache.num_used_blocks == 0
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7)
    one = roomy.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = roomy.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], seeded, use_tqdm=False)[1].outputs[0].token_ids
    assert one == mixed


def test_bfloat16_on_cuda_tracks_float32(tiny_llama_dir):
    fp32 = LLM(model=str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_blocks=64)
    bf16 = LLM(model=str(tiny_llama_dir), dtype="auto", device="cuda", num_kv_blocks=64)
    assert bf16.engine.dtype == torch.bfloat16
    first = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, first, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, first, use_tqdm=False)]
    assert sum(x[0] == y[0] for x, y in zip(a, b)) >= 2  # peaked logits: bf16 rounding rarely flips the first token


def _graph_and_eager(path, **kwargs) -> tuple[LLM, LLM]:
    model = None if path is None else str(path)
    graphs = LLM(model=model, device="cuda", **kwargs)
    eager = LLM(model=model, device="cuda", enforce_eager=True, **kwargs)
    assert graphs.engine.executor.runner.decode_graphs is not None
    assert eager.engine.executor.runner.decode_graphs is None
    return graphs, eager


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cuda_graph_decode_gives_the_eager_tokens(arch, tiny_model_dirs):
    graphs, eager = _graph_and_eager(tiny_model_dirs[arch], dtype="float32", num_kv_blocks=256)
    prompts = [f"{p} {i}" for i, p in enumerate(PROMPTS * 7)]  # 21 sequences: batches shrink over sizes
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphs.generate(prompts, params, use_tqdm=False)] == expected
    captured = graphs.engine.executor.runner.decode_graphs
    assert captured.num_replays >= 47 and len(captured.steps) >= 2
    assert all(hasattr(step.replay, "graph") for step in captured.steps.values())  # real captures
    assert graphs.stats().kv_cache.num_used_blocks == 0


def test_cuda_graph_decode_under_preemption(tiny_llama_dir):
    graphs, eager = _graph_and_eager(tiny_llama_dir, dtype="float32", num_kv_blocks=8, max_num_batched_tokens=9)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS * 2, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in graphs.generate(PROMPTS * 2, GREEDY, use_tqdm=False)] == expected
    assert graphs.stats().num_preemptions > 0 and graphs.engine.executor.runner.decode_graphs.num_replays > 0


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_tinygemm_on_cuda_matches_the_dequantized_weight(rows):
    """The CUDA packing (two codes a byte) and the scale/zero pairs: torch's int4 matmul against the
    dequantized weight's."""
    q = random_weight(3072, 576, 32).to(torch.device("cuda"))
    layer = Int4TinyGemmLinear(q, None, tinygemm_inner_k_tiles(q))
    x = torch.randn(rows, 576, device="cuda").bfloat16()
    reference = x.double() @ q.dequantize().double().T
    assert (layer(x).double() - reference).abs().max() <= 0.01 * reference.abs().max()


@pytest.fixture(scope="module")
def hf_gguf_on_cuda():
    from transformers import AutoModelForCausalLM

    from tokenmill.models.model_files import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).to("cuda").eval()


def test_default_model_on_cuda_follows_transformers(hf_gguf_on_cuda):
    """float32: dense copies of the dequantized weights, the same greedy tokens as transformers on
    the same GPU. bfloat16 (what users get): the Q4_1 linears through torch's int4 matmul, within
    near-ties of float32 transformers as on the CPU."""
    from test_default_model import check_follows_up_to_near_ties, check_greedy_matches

    fp32 = LLM(dtype="float32", device="cuda", num_kv_blocks=256)
    model = fp32.engine.executor.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, DequantizedLinear) and isinstance(model.lm_head, DequantizedLinear)
    check_greedy_matches(fp32, hf_gguf_on_cuda)
    bf16 = LLM(device="cuda", num_kv_blocks=256)
    layer, head = bf16.engine.executor.runner.model.layers[0], bf16.engine.executor.runner.model.lm_head
    assert bf16.engine.dtype == torch.bfloat16 and isinstance(head, DequantizedLinear)  # Q8_0
    assert all(isinstance(linear.batched, Int4TinyGemmLinear)
               for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    check_follows_up_to_near_ties(bf16, hf_gguf_on_cuda, later_gap=0.5)


def test_cuda_graph_decode_on_the_default_model():
    """The GGUF's own Q4_1 weights in bf16 (torch's int4 matmul inside the graph). In bf16 the
    padded attention and the eager one round differently, so the replayed graphs are compared with
    the same padded steps run without capture (the same kernels: identical tokens), and with the
    eager engine on the first tokens."""
    graphs, eager = _graph_and_eager(None, num_kv_blocks=256)
    uncaptured = LLM(device="cuda", num_kv_blocks=256)
    uncaptured.engine.executor.runner.decode_graphs.pool = None  # EagerReplay: no capture
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in uncaptured.generate(PROMPTS, params, use_tqdm=False)]
    assert not any(hasattr(s.replay, "graph") for s in uncaptured.engine.executor.runner.decode_graphs.steps.values())
    first = [o.outputs[0].token_ids[:4] for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    assert sum(g[:4] == e for g, e in zip(got, first)) >= 2


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_pool_under_a_float32_model_on_cuda(tiny_llama_dir, kv_cache_dtype):
    """The pool keeps 16-bit keys and values and every path widens what it reads: the eager
    engine and the graphs' padded attention give the same tokens, and the CPU's run of the same
    pool the same tokens and log-probabilities (the two round a key to 16 bits alike but for
    float32 last-bit differences: within 2e-3)."""
    graphs, eager = _graph_and_eager(tiny_llama_dir, dtype="float32", num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype)
    assert graphs.engine.executor.runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = eager.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in graphs.generate(PROMPTS, params, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in want]
    assert graphs.engine.executor.runner.decode_graphs.num_replays > 0
    cpu = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype)
    for ref, out in zip(cpu.generate(PROMPTS, params, use_tqdm=False), want):
        ref, out = ref.outputs[0], out.outputs[0]
        assert out.token_ids == ref.token_ids
        for token_id, a, b in zip(ref.token_ids, ref.logprobs, out.logprobs):
            assert abs(a[token_id].logprob - b[token_id].logprob) <= 2e-3


def test_server_on_cuda_answers_the_openai_client(tmp_path):
    """`tokenmill serve --device cuda` on the default model, as users get it (bf16, the GGUF's
    4-bit linears through torch's int4 matmul, decode graphs): the official client's completion,
    whole and streamed, is the engine's own greedy continuation, and chat answers."""
    import openai

    from server_harness import start_server

    llm = LLM(device="cuda", num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].text
    del llm
    server = start_server(["--device", "cuda"], tmp_path)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        kwargs = dict(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
        assert client.completions.create(**kwargs).choices[0].text == want
        assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == want
        chat = client.chat.completions.create(model=model, max_tokens=8,
                                              messages=[{"role": "user", "content": "Say hello."}])
        assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
        assert server.metric("tokenmill:generation_tokens_total") == 48 + chat.usage.completion_tokens
    finally:
        assert server.stop() == 0, server.log()
