"""Same greedy tokens however the work is batched: alone, together, chunked, prefix hits, preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.cpu_kernels import (
    decode_attention_rows_available, prefill_attention_available, quant_gemm_i8_available,
)
from tokenmill.layers.quantized import QuantizedLinear

SHARED = "Once upon a time, in a kingdom by the sea, there lived a king who loved numbers more than gold. "
PROMPTS = [
    SHARED + "Every morning he counted",
    SHARED + "His daughter, however, preferred",
    "A completely different prompt about rivers and mountains and the weather in spring",
    "Short",
    SHARED * 3 + "And so the story goes on and on",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=[{}, {"quantization": "int4"}, {"kv_cache_dtype": "float16"}],
                ids=["float", "int4", "fp16-kv"])
def variant(request):
    """Every invariance holds for a model whose linears are quantized too, and for a float32 model
    keeping a 16-bit KV cache (fresh prompts attend to keys and values rounded as cached ones are)."""
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, variant):
    """Each prompt run alone, without prefix caching."""
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False, **variant)
    layers = list(llm.engine.executor.loaded.model.modules())
    assert any(isinstance(m, QuantizedLinear) for m in layers) == ("quantization" in variant)
    assert llm.engine.executor.runner.kv_cache.dtype == getattr(torch, variant.get("kv_cache_dtype", "float32"))
    return [_tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def test_all_together(tiny_llama_dir, reference, variant):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False, **variant)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_chunked_prefill(tiny_llama_dir, reference, variant):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=7, **variant)
    assert _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_prefix_cache_hits(tiny_llama_dir, reference, variant):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, **variant)
    first = _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    hits_before = llm.stats().kv_cache.prefix_cache_hits
    rest = _tokens(llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False))
    stats = llm.stats().kv_cache
    assert stats.prefix_cache_hits - hits_before >= 32  # the shared prefix spans at least two blocks
    again = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))  # everything cached now
    assert first + rest == reference
    assert again == reference
    assert stats.num_used_blocks == 0


def test_prefix_hit_logprobs_equal_a_fresh_prompts(tiny_llama_dir, variant):
    """Not only the tokens: a prompt whose prefix was cached attends to the same keys and values as
    one computed whole (with a 16-bit cache: rounded the same way; unrounded fresh keys would put
    the log-probabilities ~1e-3 apart). The two attend in different kernels: within 1e-4; with
    int4 linears within 1e-3, since the quantized kernels round a step's activations by its rows
    (2.5e-4 measured on an AVX2 CPU)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    fresh = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False, **variant)
    want = fresh.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, **variant)
    llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    hit = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 16
    got = hit.outputs[0]
    assert got.token_ids == want.token_ids
    assert [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)] == \
        pytest.approx([lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)],
                      abs=1e-3 if "quantization" in variant else 1e-4)


def test_preemption(tiny_llama_dir, reference, variant):
    # Each prompt needs up to 10 blocks to finish; 14 blocks cannot hold them all at once.
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, enable_prefix_caching=False, **variant)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert any(o.metrics.num_preemptions > 0 for o in outputs)
    assert _tokens(outputs) == reference
    assert llm.stats().kv_cache.num_used_blocks == 0


def test_preemption_with_prefix_cache_and_chunking(tiny_llama_dir, reference, variant):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, max_num_batched_tokens=9, **variant)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    assert _tokens(outputs) == reference


@pytest.mark.slow
def test_default_model_batch_equals_alone(default_llm):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    prompts = ["The three primary colours are", "Water boils at", "A haiku about the sea:\n"]
    together = _tokens(default_llm.generate(prompts, params, use_tqdm=False))
    alone = [_tokens(default_llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    assert together == alone


def _bit_equal_by_default() -> bool:
    """Whether this CPU's default dtype has kernels that compute a prompt's rows as decode steps do,
    bit for bit: bf16 on AVX-512 (csrc/prefill_attention.cpp), float32 on the AVX2 build
    (decode_attention_rows for every token, quant_gemv_i8 for every batch, rows rounded to 8 bits)."""
    return prefill_attention_available() or (decode_attention_rows_available() and quant_gemm_i8_available())


@pytest.mark.slow
@pytest.mark.skipif(not _bit_equal_by_default(), reason="bit-equal rows need the AVX-512 kernels or the AVX2 build")
def test_default_model_gives_the_same_bits_however_prompts_are_cut():
    """In the CPU's default dtype, not only the tokens but every log-probability: a prompt whose last
    token is computed alone (a 1-token chunk, a prefix hit leaving one token: the decode kernel's
    row) or recomputed after preemption (generated tokens re-run as a prompt) equals the prompt run
    whole. In bf16 the prefill kernel computes each row in the decode kernel's order; before it did,
    3 of these 12 prompts changed a token under the 9-token budget and 2 under preemption. On the
    AVX2 build (float32) every token is a query of the decode op and every batch rounds its rows to
    8 bits as decode does; before, with SDPA and oneDNN for prompts, every prompt's log-probs changed
    under the 9-token budget, prefix hits and preemption."""
    words = (Path(__file__).parents[1] / "benchmarks" / "data" / "mills.txt").read_text().split()
    prompts = [" ".join(words[i * 40 : i * 40 + 25 + 3 * i]) for i in range(12)]  # 25..58 words
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=0)

    def run(llm, batch):
        outs = [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]
        return [(o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]

    alone = LLM(num_kv_blocks=512, enable_prefix_caching=False)
    reference = [run(alone, [p])[0] for p in prompts]
    chunked = LLM(num_kv_blocks=512, enable_prefix_caching=False, max_num_batched_tokens=9)
    assert run(chunked, prompts) == reference
    cached = LLM(num_kv_blocks=512)
    run(cached, prompts)
    hits = run(cached, prompts)
    assert cached.stats().kv_cache.prefix_cache_hits > 0
    assert hits == reference
    tight = LLM(num_kv_blocks=20, enable_prefix_caching=False)
    assert run(tight, prompts) == reference
    assert tight.stats().num_preemptions > 0


def test_seeded_sampling_survives_preemption_and_chunking(tiny_llama_dir):
    params = [SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(PROMPTS))]
    roomy = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    alone = [_tokens(roomy.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS, params)]
    tight = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=14, max_num_batched_tokens=9)
    outputs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.stats().num_preemptions > 0 and any(o.metrics.num_preemptions > 0 for o in outputs)
    assert _tokens(outputs) == alone
    greedy = _tokens(roomy.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert _tokens(outputs) != greedy  # really sampled


def test_parallel_samples_share_the_prompt_blocks(tiny_llama_dir):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    unshared = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    expected = [c.token_ids for c in unshared.generate(PROMPTS[4], params, use_tqdm=False)[0].outputs]
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)
    engine = llm.engine
    prompt_ids = engine.tokenize(PROMPTS[4])
    full_blocks = (len(prompt_ids) - 1) // 16
    engine.add_request("shared", prompt_ids, params)
    engine.step()  # the first sample prefills the prompt; its siblings wait for its blocks
    assert engine.kv_cache.block_ids("shared#1") == []
    engine.step()  # the siblings start from the cached prompt blocks
    leader_blocks = engine.kv_cache.block_ids("shared#0")[:full_blocks]
    for i in (1, 2, 3):
        assert engine.kv_cache.block_ids(f"shared#{i}")[:full_blocks] == leader_blocks
    assert engine.kv_cache.stats().prefix_cache_hits == 3 * full_blocks * 16
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [c.token_ids for c in outputs[0].outputs] == expected
    assert engine.kv_cache.stats().num_used_blocks == 0
