"""csrc/prefill_attention.cpp: causal attention of fresh bf16 prompt chunks, against float64."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers import attention
from tokenmill.layers.attention import CacheGeometry, TorchPagedAttention
from tokenmill.layers.cpu_kernels import prefill_attention_available

needs_kernel = pytest.mark.skipif(not prefill_attention_available(), reason="prefill_attention_ is the AVX-512 build's")


def fused_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """q, k, v as the attention layer gets them: row-strided slices of one [T, (H + 2 Hkv) D] tensor."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).bfloat16()
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    return q, k, v


def reference(q, k, v, start: int, length: int, scale: float) -> torch.Tensor:
    """[length, H * D] in float64: each query attends to its chunk's keys up to its own position."""
    rows = slice(start, start + length)
    groups = q.shape[1] // k.shape[1]
    qs = q[rows].double().transpose(0, 1)  # [H, L, D]
    ks = k[rows].double().repeat_interleave(groups, dim=1).transpose(0, 1)
    vs = v[rows].double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = qs @ ks.transpose(1, 2) * scale
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (probs @ vs).transpose(0, 1).reshape(length, -1)


def run_kernel(q, k, v, chunks, scale, fill=7.0):
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), fill, dtype=torch.bfloat16)
    starts, lengths = torch.tensor(chunks, dtype=torch.int64).view(-1, 2).unbind(1)
    torch.ops.tokenmill.prefill_attention_(out, q, k, v, starts, lengths, scale)
    return out


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_kernel_equals_causal_attention_in_float64(heads, kv_heads, head_dim):
    """Chunks of 1..257 tokens (tails of every kind: rows of 4, key blocks of 16 and 32, an odd key
    count) with gaps between them: each row is the float64 attention of its chunk, within the bf16
    rounding of the probabilities and of the output; rows outside every chunk are left alone."""
    chunks = [(0, 1), (1, 2), (4, 5), (9, 16), (25, 17), (50, 33), (83, 100), (190, 257)]  # rows 3, 42..49 free
    tokens = 450
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, seed=head_dim + heads)
    if heads == kv_heads:
        k = k.contiguous()  # normed keys (Qwen3's q/k norm) come as their own tensor: another row stride
    scale = head_dim**-0.5
    out = run_kernel(q, k, v, chunks, scale)
    covered = torch.zeros(tokens, dtype=torch.bool)
    for start, length in chunks:
        want = reference(q, k, v, start, length, scale)
        got = out[start : start + length].double()
        # probabilities rounded to bf16: <= 2^-9 of each term, so of max |v|; the output: 2^-9 of itself
        bound = 2**-8 * v[start : start + length].abs().max().double() + 2**-8 * want.abs()
        assert ((got - want).abs() <= bound).all(), (start, length, ((got - want).abs() - bound).max().item())
        covered[start : start + length] = True
    assert (out[~covered] == 7.0).all()
    assert (out[covered] != 7.0).any()


@needs_kernel
def test_first_rows_attend_to_themselves_only():
    """The causal limit exactly: row 0 of a chunk is its own value; row 1 mixes rows 0 and 1 only."""
    q, k, v = fused_qkv(40, 2, 1, 64, seed=3)
    out = run_kernel(q, k, v, [(8, 32)], 0.125)
    head = out[8].view(2, 64)
    assert torch.equal(head[0], v[8, 0]) and torch.equal(head[1], v[8, 0])
    want = reference(q, k, v, 8, 32, 0.125)[1]
    assert (out[9].double() - want).abs().max() <= 2**-7 * v[8:10].abs().max()


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    q, k, v = fused_qkv(8, 2, 1, 48, seed=0)  # head_dim not a multiple of 32
    with pytest.raises(RuntimeError, match="multiple of 32"):
        run_kernel(q, k, v, [(0, 8)], 0.1)
    q, k, v = fused_qkv(8, 2, 1, 64, seed=0)
    with pytest.raises(RuntimeError, match="bf16"):
        run_kernel(q.float(), k.float(), v.float(), [(0, 8)], 0.1)
    with pytest.raises(RuntimeError, match="outside"):
        run_kernel(q, k, v, [(4, 8)], 0.1)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        run_kernel(q[:, :1].expand(8, 3, 64), k.expand(8, 2, 64), v.expand(8, 2, 64), [(0, 8)], 0.1)


@needs_kernel
def test_fresh_prefills_take_the_kernel_and_agree_with_sdpa(monkeypatch):
    """The attention backend's fresh chunks (nothing cached) go through the kernel in bf16 on CPU,
    and give SDPA's rows within bf16 noise; switched off, SDPA runs."""
    geometry = CacheGeometry(block_size=16, num_blocks=40, num_kv_heads=3, num_query_groups=3, head_dim=64,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
    backend = TorchPagedAttention()
    md = backend.build_metadata([70, 1, 33], [0, 9, 0], [[1, 2, 3, 4, 5], [6], [7, 8, 9]], geometry)
    assert md.fresh_prefills == [(0, 70), (71, 33)]
    q, k, v = fused_qkv(104, 9, 3, 64, seed=11)
    kv = torch.zeros(2, 3, 40, 16, 64, dtype=torch.bfloat16)
    kernel_out = backend.forward(q, k, v, kv[0], kv[1], md, 0.125)
    monkeypatch.setattr(attention, "_prefill_kernel_available", lambda: False)
    sdpa_out = backend.forward(q, k, v, kv[0], kv[1], md, 0.125)
    for start, length in md.fresh_prefills:
        rows = slice(start, start + length)
        want = reference(q, k, v, start, length, 0.125)
        assert (kernel_out[rows].double() - want).abs().max() <= 2**-7 * v[rows].abs().max()
        torch.testing.assert_close(kernel_out[rows], sdpa_out[rows], rtol=2**-7, atol=2**-7 * float(v[rows].abs().max()))
    assert not torch.equal(kernel_out[:70], sdpa_out[:70])  # two different paths ran
    torch.testing.assert_close(kernel_out[70], sdpa_out[70], rtol=0, atol=0)  # the decode row: the same path


def test_sdpa_where_the_kernel_does_not_apply(monkeypatch):
    """float32, or no kernel: the backend's SDPA per chunk, equal to float64 attention."""
    geometry = CacheGeometry(block_size=16, num_blocks=8, num_kv_heads=2, num_query_groups=2, head_dim=32,
                             dtype=torch.float32, device=torch.device("cpu"))
    md = TorchPagedAttention().build_metadata([20, 9], [0, 0], [[0, 1], [2]], geometry)
    q, k, v = (t.float() for t in fused_qkv(29, 4, 2, 32, seed=5))
    kv = torch.zeros(2, 2, 8, 16, 32)
    out = TorchPagedAttention().forward(q, k, v, kv[0], kv[1], md, 0.2)
    for start, length in md.fresh_prefills:
        torch.testing.assert_close(out[start : start + length].double(), reference(q, k, v, start, length, 0.2),
                                   rtol=1e-5, atol=1e-5)


def paged_cache(k: torch.Tensor, v: torch.Tensor, sequences: list[tuple[int, int]], block_size: int, seed: int):
    """k, v [T, Hkv, D] of sequences (first row, tokens) written into a paged cache in the CPU
    backend's layout (keys by column pairs, values by row), their blocks scattered over the pool;
    returns the caches and each sequence's block table (padded with its first block)."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    needed = [-(-length // block_size) for _, length in sequences]
    order = torch.randperm(sum(needed) + 3, generator=torch.Generator().manual_seed(seed)).tolist()
    k_cache = torch.zeros(kv_heads, len(order), block_size, head_dim, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    by_column = k_cache.view(kv_heads, len(order), head_dim // 2, block_size, 2)
    tables = []
    for (first, length), count in zip(sequences, needed):
        blocks, order = order[:count], order[count:]
        tables.append(blocks + [blocks[0]] * (max(needed) - count))
        for t in range(length):
            block, row = blocks[t // block_size], t % block_size
            by_column[:, block, :, row, :] = k[first + t].view(kv_heads, head_dim // 2, 2)
            v_cache[:, block, row] = v[first + t]
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int64)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 32, 8])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128)])
def test_paged_kernel_equals_attention_after_cached_tokens(block_size, heads, kv_heads, head_dim):
    """Chunks after 0..100 cached tokens, read through scattered blocks: query i of a chunk is the
    float64 attention of its sequence's keys 0 .. context + i, within bf16 rounding."""
    sequences = [(0, 1, 5), (10, 3, 16), (40, 16, 17), (80, 40, 100), (300, 7, 0)]  # (first row, chunk, context)
    tokens = 320
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, seed=block_size + head_dim)
    k_cache, v_cache, table = paged_cache(k, v, [(first, ctx + n) for first, n, ctx in sequences], block_size, 1)
    # the chunk's queries are the sequence's last rows; put them at rows starts (any place in the step)
    starts = torch.tensor([200 + 50 * i for i in range(len(sequences))][:4] + [10], dtype=torch.int64)
    qs = torch.zeros(tokens + 100, heads, head_dim, dtype=torch.bfloat16)
    for (first, n, ctx), start in zip(sequences, starts.tolist()):
        qs[start : start + n] = q[first + ctx : first + ctx + n]
    out = torch.full((tokens + 100, heads * head_dim), 7.0, dtype=torch.bfloat16)
    lengths = torch.tensor([n for _, n, _ in sequences])
    context = torch.tensor([ctx for _, _, ctx in sequences])
    torch.ops.tokenmill.paged_prefill_attention_(out, qs, k_cache, v_cache, table, context, starts, lengths, 0.125)
    written = torch.zeros(len(out), dtype=torch.bool)
    for (first, n, ctx), start in zip(sequences, starts.tolist()):
        want = reference(q, k, v, first, ctx + n, 0.125)[ctx:]  # the chunk's rows of the whole sequence
        got = out[start : start + n].double()
        bound = 2**-8 * v[first : first + ctx + n].abs().max().double() + 2**-8 * want.abs()
        assert ((got - want).abs() <= bound).all(), (first, n, ctx)
        written[start : start + n] = True
    assert (out[~written] == 7.0).all()


@needs_kernel
def test_paged_kernel_refuses_what_it_cannot_take():
    q, k, v = fused_qkv(40, 2, 1, 64, seed=0)
    k_cache, v_cache, table = paged_cache(k, v, [(0, 40)], 16, 0)
    out = torch.zeros(40, 128, dtype=torch.bfloat16)
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="more keys than its block table"):
        torch.ops.tokenmill.paged_prefill_attention_(out, q, k_cache, v_cache, table, torch.tensor([40]),
                                                     torch.tensor([0]), torch.tensor([9]), 0.1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tokenmill.paged_prefill_attention_(out, q, k_cache, v_cache, table + 100, one, one, one, 0.1)
    with pytest.raises(RuntimeError, match="caches"):
        torch.ops.tokenmill.paged_prefill_attention_(out, q, k_cache.float(), v_cache.float(), table, one, one, one, 0.1)


@needs_kernel
def test_chunks_after_cached_tokens_take_the_paged_kernel_and_agree_with_sdpa(monkeypatch):
    """Through the CPU backend: a prompt's second chunk (after 40 cached tokens) beside a fresh one;
    the paged kernel's rows equal the padded SDPA's (kernel off) within bf16 noise."""
    from tokenmill.layers.cpu_attention import CpuPagedAttention, KernelPrefillChunks

    geometry = CacheGeometry(block_size=16, num_blocks=20, num_kv_heads=3, num_query_groups=3, head_dim=64,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
    q, k, v = fused_qkv(100, 9, 3, 64, seed=21)
    results = []
    for kernel in (True, False):
        monkeypatch.setattr(attention, "_prefill_kernel_available", lambda kernel=kernel: kernel)
        kv = torch.zeros(2, 3, 20, 16, 64, dtype=torch.bfloat16)
        backend = CpuPagedAttention()
        first = backend.build_metadata([40], [0], [[7, 2, 9]], geometry)  # rows 0..39 of the sequence
        backend.forward(q[:40], k[:40], v[:40], kv[0], kv[1], first, 0.125)
        second = backend.build_metadata([30, 30], [40, 0], [[7, 2, 9, 4, 11], [1, 3]], geometry)
        assert isinstance(second.prefill, KernelPrefillChunks) == kernel
        results.append(backend.forward(q[40:100], k[40:100], v[40:100], kv[0], kv[1], second, 0.125))
    with_kernel, with_sdpa = results
    want = reference(q, k, v, 0, 70, 0.125)[40:]
    assert (with_kernel[:30].double() - want).abs().max() <= 2**-7 * v[:70].abs().max()
    torch.testing.assert_close(with_kernel, with_sdpa, rtol=2**-7, atol=2**-7 * float(v.abs().max()))
    assert not torch.equal(with_kernel[:30], with_sdpa[:30])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (4, 4, 32)])
def test_each_row_is_the_decode_kernels_row_bit_for_bit(heads, kv_heads, head_dim):
    """A prompt's row computed in a chunk (fresh or after cached tokens) is the row paged_decode
    computes for that position: a prompt's last token taken alone (a 1-token chunk goes through the
    decode path) or recomputed after preemption then gives the same bits as in one whole prefill."""
    tokens, block_size, scale = 75, 16, head_dim**-0.5
    q, k, v = fused_qkv(tokens, heads, kv_heads, head_dim, seed=head_dim + 5)
    k_cache, v_cache, table = paged_cache(k, v, [(0, tokens)], block_size, seed=3)
    fresh = run_kernel(q, k, v, [(0, tokens)], scale)
    paged = torch.zeros(tokens, heads * head_dim, dtype=torch.bfloat16)
    context = 23  # rows 23.. as a chunk after 23 cached tokens
    torch.ops.tokenmill.paged_prefill_attention_(paged, q, k_cache, v_cache, table, torch.tensor([context]),
                                                 torch.tensor([context]), torch.tensor([tokens - context]), scale)
    decoded = torch.cat([
        torch.ops.tokenmill.paged_decode(q[t : t + 1].contiguous(), k_cache, v_cache, table,
                                         torch.tensor([t + 1]), scale, tokens).view(1, -1)
        for t in range(tokens)])
    assert torch.equal(fresh, decoded)
    assert torch.equal(paged[context:], decoded[context:])
