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
