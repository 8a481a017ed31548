"""csrc/decode_attention_rows.cpp (the AVX2 build's decode attention over the PyTorch backend's
cache rows) against TorchPagedAttention's own PyTorch decode path."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import attention
from tokenmill.layers.attention import CacheGeometry, TorchPagedAttention
from tokenmill.layers.cpu_kernels import decode_attention_rows_available

pytestmark = pytest.mark.skipif(not decode_attention_rows_available(), reason="the AVX2 build's op")


def _decode_step(dtype: torch.dtype, groups: int, head_dim: int, use_kernel: bool, monkeypatch,
                 cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A prefill of three sequences (different lengths, scattered blocks), then one decode step's output."""
    monkeypatch.setattr(attention, "_rows_kernel_available", lambda: use_kernel)
    kv_heads, block_size, num_blocks = 2, 16, 12
    geometry = CacheGeometry(block_size, num_blocks, kv_heads, groups, head_dim, dtype, torch.device("cpu"))
    backend = TorchPagedAttention()
    caches = (torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=cache_dtype or dtype),
              torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=cache_dtype or dtype))
    gen = torch.Generator().manual_seed(0)
    tables, prompt_lens = [[3, 7, 1], [0, 11], [5]], [40, 16, 9]
    out = None
    for query_lens, context_lens in [(prompt_lens, [0, 0, 0]), ([1, 1, 1], prompt_lens)]:
        tokens = sum(query_lens)
        q = torch.randn(tokens, kv_heads * groups, head_dim, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        metadata = backend.build_metadata(query_lens, context_lens, tables, geometry)
        out = backend.forward(q, k, v, *caches, metadata, head_dim**-0.5)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups,head_dim", [(1, 64), (3, 64), (8, 32), (2, 80), (3, 20)])
def test_kernel_decode_equals_the_pytorch_path(dtype, groups, head_dim, monkeypatch):
    got = _decode_step(dtype, groups, head_dim, True, monkeypatch)
    want = _decode_step(dtype, groups, head_dim, False, monkeypatch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("groups,head_dim", [(3, 64), (2, 80)])
def test_a_16_bit_cache_under_float32_queries(cache_dtype, groups, head_dim, monkeypatch):
    """A float32 model's 16-bit pool (kv_cache_dtype): the kernel widens each row as it reads it,
    so it computes what it computes over the widened cache, bit for bit; the PyTorch path agrees."""
    got = _decode_step(torch.float32, groups, head_dim, True, monkeypatch, cache_dtype)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _decode_step(torch.float32, groups, head_dim, False, monkeypatch, cache_dtype),
                               rtol=1e-5, atol=1e-5)
    q = torch.randn(2, 2 * groups, head_dim)
    cache = torch.randn(2, 4, 16, head_dim).to(cache_dtype)
    table, lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([20, 5])
    narrow = torch.ops.tokenmill.decode_attention_rows(q, cache, cache, table, lens, 0.2)
    assert torch.equal(narrow, torch.ops.tokenmill.decode_attention_rows(q, cache.float(), cache.float(), table, lens, 0.2))
    with pytest.raises(RuntimeError, match="16-bit one under float32"):
        torch.ops.tokenmill.decode_attention_rows(q.bfloat16(), cache.float(), cache.float(), table, lens, 0.2)


def test_kernel_takes_strided_query_rows():
    q = torch.randn(2, 6, 32)[:, :4]  # [B, 4 heads, D]: rows of a wider tensor, as a fused qkv gives
    cache = torch.randn(2, 4, 16, 32)
    table, lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([20, 5])
    got = torch.ops.tokenmill.decode_attention_rows(q, cache, cache, table, lens, 0.2)
    want = torch.ops.tokenmill.decode_attention_rows(q.contiguous(), cache, cache, table, lens, 0.2)
    assert torch.equal(got, want)


def test_kernel_refuses_a_block_past_the_cache():
    q, cache = torch.randn(1, 2, 32), torch.zeros(1, 4, 16, 32)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.tokenmill.decode_attention_rows(q, cache, cache, torch.tensor([[4]]), torch.tensor([3]), 1.0)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_write_kv_rows_equals_the_pytorch_write(dtype, cache_dtype):
    """write_kv_rows puts the step's keys and values in the rows attention.write_kv does, rounded
    the same way, from strided views of a fused projection's output (as the decode plan passes them)."""
    kv_heads, head_dim, tokens = 3, 64, 5
    geometry = CacheGeometry(16, 6, kv_heads, 3, head_dim, dtype, torch.device("cpu"))
    layout = attention.StepLayout.build([1, 3, 1], [20, 0, 47], [[2, 5], [0], [1, 3, 4, 5]], geometry)
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * head_dim).to(dtype)
    k = qkv[:, 9 * head_dim : 12 * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 12 * head_dim :].view(tokens, kv_heads, head_dim)
    want = [torch.zeros(kv_heads, 6, 16, head_dim, dtype=cache_dtype) for _ in range(2)]
    got = [torch.zeros_like(c) for c in want]
    attention.write_kv(*want, layout.write_index, k, v)
    torch.ops.tokenmill.write_kv_rows(k, v, *got, layout.write_index)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and want[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.tokenmill.write_kv_rows(k, v, *got, layout.write_index + 6 * 16 * kv_heads)


def test_the_kernels_decode_bucket_leaves_out_the_pytorch_paths_tensors(monkeypatch):
    for use_kernel in (True, False):
        monkeypatch.setattr(attention, "_rows_kernel_available", lambda: use_kernel)
        geometry = CacheGeometry(16, 6, 2, 3, 64, torch.float32, torch.device("cpu"))
        bucket = TorchPagedAttention().build_metadata([1, 1], [20, 3], [[2, 5], [0]], geometry).decode
        assert bucket.block_table.tolist() == [[2, 5], [0, 0]] and bucket.seq_lens.tolist() == [21, 4]
        assert (bucket.gather_index is None) == use_kernel and (bucket.value_index is None) == use_kernel


def _run_steps(steps, tables, dtype, use_kernel, monkeypatch, seed=0, kv_heads=2, groups=3, head_dim=64,
               cache_dtype=None):
    """Runs steps [(query_lens, context_lens)] over fresh caches; returns each step's output and
    the per-token q, k, v it was given (drawn per sequence and position, so that however a prompt
    is cut, its token at position p sees the same q, k, v)."""
    monkeypatch.setattr(attention, "_rows_kernel_available", lambda: use_kernel)
    block_size, num_blocks = 16, 12
    geometry = CacheGeometry(block_size, num_blocks, kv_heads, groups, head_dim, dtype, torch.device("cpu"))
    backend = TorchPagedAttention()
    caches = [torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=cache_dtype or dtype) for _ in range(2)]
    gen = torch.Generator().manual_seed(seed)
    width = (kv_heads * groups + 2 * kv_heads) * head_dim
    drawn = torch.randn(len(tables), 64, width, generator=gen).to(dtype)  # [sequence, position, q|k|v]
    outs = []
    for query_lens, context_lens in steps:
        rows = torch.cat([drawn[s, c : c + n] for s, (n, c) in enumerate(zip(query_lens, context_lens)) if n])
        q = rows[:, : kv_heads * groups * head_dim].view(-1, kv_heads * groups, head_dim)
        k = rows[:, kv_heads * groups * head_dim : (kv_heads * groups + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        v = rows[:, (kv_heads * groups + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
        live = [i for i, n in enumerate(query_lens) if n]
        metadata = backend.build_metadata([query_lens[i] for i in live], [context_lens[i] for i in live],
                                          [tables[i] for i in live], geometry)
        if use_kernel:
            assert (metadata.prefill is None) == (max(query_lens) == 1)
        outs.append(backend.forward(q, k, v, *caches, metadata, head_dim**-0.5))
    return outs


# three sequences: a 40-token prompt, a 16-token one after a 9-token step, and a decode
TABLES = [[3, 7, 1], [0, 11], [5, 2]]
MIXED = [([9, 9, 9], [0, 0, 0]), ([31, 16, 1], [9, 9, 9]), ([1, 1, 1], [40, 25, 10])]


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.float16)])
def test_steps_with_prompts_equal_the_pytorch_path(dtype, cache_dtype, monkeypatch):
    """Fresh prompts, chunks after cached tokens and decodes in one step: the kernel's per-token
    queries give what the PyTorch path's SDPA and decode buckets give."""
    got = _run_steps(MIXED, TABLES, dtype, True, monkeypatch, cache_dtype=cache_dtype)
    want = _run_steps(MIXED, TABLES, dtype, False, monkeypatch, cache_dtype=cache_dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_rows_are_the_same_bits_however_it_is_cut(dtype, monkeypatch):
    """Each row of a prompt equals, bit for bit, that token's row when the prompt comes whole,
    in chunks (a step with other sequences' work in it) or one token at a time (decode steps)."""
    whole = _run_steps([([40, 25, 10], [0, 0, 0])], TABLES, dtype, True, monkeypatch)[0]
    cut = _run_steps(MIXED[:2], TABLES, dtype, True, monkeypatch)
    one_at_a_time = _run_steps([([1, 1, 1], [p, p, p]) for p in range(10)], TABLES, dtype, True, monkeypatch)
    # rows of `whole` by (sequence, position)
    starts = [0, 40, 65]
    assert torch.equal(torch.cat([cut[0][0:9], cut[1][0:31]]), whole[0:40])
    assert torch.equal(torch.cat([cut[0][9:18], cut[1][31:47]]), whole[40:65])
    assert torch.equal(torch.cat([cut[0][18:27], cut[1][47:48]]), whole[65:75])
    for p, step in enumerate(one_at_a_time):
        for s in range(3):
            assert torch.equal(step[s], whole[starts[s] + p]), (p, s)


def test_work_split_over_threads_leaves_no_query_out():
    """A long prompt's queries over two threads (runs of equal work, not of equal counts): every
    row computed, each the same as computed alone."""
    gen = torch.Generator().manual_seed(1)
    L, kv_heads, groups, D = 300, 2, 3, 64
    cache = torch.randn(kv_heads, 19, 16, D, generator=gen)
    q = torch.randn(L, kv_heads * groups, D, generator=gen)
    table = torch.arange(19).expand(L, -1)
    lens = torch.arange(1, L + 1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = torch.ops.tokenmill.decode_attention_rows(q, cache, cache, table, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    for t in (0, 1, 149, 150, 211, 299):
        alone = torch.ops.tokenmill.decode_attention_rows(q[t : t + 1], cache, cache, table[:1], lens[t : t + 1], 0.125)
        assert torch.equal(together[t], alone[0]), t
    assert torch.isfinite(together).all()
    # one long sequence (a single stream's decode step): its kv heads are the runs, one per thread
    try:
        torch.set_num_threads(2)
        split = torch.ops.tokenmill.decode_attention_rows(q[-1:], cache, cache, table[:1], lens[-1:], 0.125)
        torch.set_num_threads(1)
        one = torch.ops.tokenmill.decode_attention_rows(q[-1:], cache, cache, table[:1], lens[-1:], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, one) and torch.equal(split[0], together[-1])


def test_a_model_with_more_query_heads_per_kv_head_than_the_op_takes(tmp_path, tokenizer_dir, monkeypatch):
    """16 query heads per kv head, past decode_attention_rows' 8: its steps take the PyTorch path
    (decode raised before) and greedy tokens are transformers'."""
    import shutil

    import transformers

    from tokenmill import LLM, SamplingParams

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=1, max_position_embeddings=256,
                                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    prompt = [5, 17, 123, 42, 7, 250, 3, 99, 1000, 12]
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64)
    ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()
    # quantized, every projection on quant_gemv_i8: the one-call decode step is not for it either
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    quantized = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, quantization="int4")
    layered = quantized.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setenv("TOKENMILL_DECODE_LAYERS", "0")
    per_layer = LLM(model=str(tmp_path), dtype="float32", num_kv_blocks=64, quantization="int4")
    assert per_layer.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == layered
