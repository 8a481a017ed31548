"""The fused per-layer ops (csrc/fused_ops.cpp) against the PyTorch code they replace, and a model
whose layers use them against the same model on the PyTorch path."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import activation, norm, rotary
from tokenmill.layers.attention import CacheGeometry, TorchPagedAttention
from tokenmill.layers.cpu_attention import CpuPagedAttention
from tokenmill.layers.cpu_kernels import fused_ops_available, kernels_available
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import MATRIX_ROTATION_MAX_TOKENS, RotaryEmbedding, apply_rotary, rotation_matrices

pytestmark = pytest.mark.skipif(not fused_ops_available(), reason="the fused ops need AVX-512 or AVX2")
needs_avx512 = pytest.mark.skipif(not kernels_available(), reason="the kernel needs AVX-512")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one rounding of the result, against PyTorch's op-by-op rounding
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _unfused(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setattr(module, "_fused_available", lambda: False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_and_the_fused_residual_add(dtype, rows, monkeypatch):
    layer = RMSNorm(96, 1e-5)
    layer.weight.data = (torch.rand(96) + 0.5).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    residual = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        fused_plain = layer(x)
        fused_residual = residual.clone()
        fused = layer(x, fused_residual)
        _unfused(monkeypatch, norm)
        want_plain = layer(x)
        want_residual = residual.clone()
        want = layer(x, want_residual)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused_plain, want_plain, rtol=tol, atol=tol)
    torch.testing.assert_close(fused_residual, want_residual, rtol=0, atol=0)  # the sum is rounded the same way
    torch.testing.assert_close(fused, want, rtol=tol, atol=tol)
    assert not torch.equal(fused_residual, residual)  # it was added to in place
    # the sum is normalised as rounded and stored: bit for bit the plain norm of the stored sum
    torch.testing.assert_close(fused, torch.ops.tokenmill.rms_norm(fused_residual, layer.weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view(dtype, monkeypatch):
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    rope.build_cache(torch.device("cpu"))
    positions = torch.tensor([0, 7, 300, 511])
    qkv = torch.randn(4, 7 * 64).to(dtype)  # 5 q/k heads, then 2 value heads: the q/k view has row stride 7 * 64
    qk = qkv[:, : 5 * 64].view(4, 5, 64)
    want = apply_rotary(qk.clone(), *rope.cos_sin(positions, torch.float32)).to(dtype)
    untouched = qkv[:, 5 * 64 :].clone()
    out = rope.step(positions, dtype).rotate(qk)
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * 4)
    assert torch.equal(qkv[:, 5 * 64 :], untouched)
    _unfused(monkeypatch, rotary)
    assert rope.step(positions, dtype).tables is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matrices_rotate_as_the_tables(dtype):
    """The GPU's short steps rotate q and k (a strided view of the fused qkv) by one batched matmul
    with per-token matrices: the tables' rotation, at least as close to float64's."""
    rope = RotaryEmbedding(64, 600, 10000.0, None)
    rope.build_cache(torch.device("cpu"))
    positions = torch.tensor([0, 7, 300, 599])
    cos, sin = rope.cos_sin(positions, dtype)
    qkv = torch.randn(4, 20 * 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    qk = qkv[:, : 16 * 64].view(4, 16, 64)
    exact = apply_rotary(qk.double(), *rope.cos_sin(positions, torch.float64))
    by_tables, by_matrices = apply_rotary(qk, cos, sin), torch.bmm(qk, rotation_matrices(cos, sin))
    assert (by_matrices.double() - exact).abs().max() <= (by_tables.double() - exact).abs().max() + 1e-7
    torch.testing.assert_close(by_matrices, by_tables, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_steps_off_the_cpu_rotate_by_matrices_up_to_a_length():
    rope = RotaryEmbedding(64, 600, 10000.0, None)
    rope.build_cache(torch.device("meta"))
    short = rope.step(torch.zeros(MATRIX_ROTATION_MAX_TOKENS, dtype=torch.int64, device="meta"), torch.bfloat16)
    assert short.matrices is not None and short.matrices.shape == (MATRIX_ROTATION_MAX_TOKENS, 64, 64)
    long = rope.step(torch.zeros(MATRIX_ROTATION_MAX_TOKENS + 1, dtype=torch.int64, device="meta"), torch.bfloat16)
    assert long.matrices is None and long.tables is not None


def test_rotary_refuses_positions_past_the_table():
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    rope.build_cache(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="past the table"):
        rope.step(torch.tensor([8]), torch.float32).rotate(torch.randn(1, 2, 16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, monkeypatch):
    x = torch.randn(5, 2 * 80).to(dtype) * 3
    fused = activation.silu_and_mul(x)
    _unfused(monkeypatch, activation)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused, activation.silu_and_mul(x), rtol=tol, atol=tol)


@needs_avx512
@pytest.mark.parametrize("cols", [1, 15, 16, 17, 1000, 49152])
def test_argmax_rows_is_torchs_argmax_ties_and_nans_included(cols):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randint(-3, 4, (6, cols), generator=gen).float()  # many equal maxima: the first one wins
    x[1] = float("-inf")
    x[2, cols // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
    x[3, -1] = float("nan")
    x[3, 0] = float("nan")
    x[4] = torch.randn(cols, generator=gen)
    x[5, cols - 1] = 100.0  # the masked tail of the last vector
    got = torch.ops.tokenmill.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    strided = torch.randn(4, 2 * cols, generator=gen)[:, :cols]  # rows of a wider tensor
    assert torch.equal(torch.ops.tokenmill.argmax_rows(strided), strided.argmax(dim=-1))


@needs_avx512  # the decode kernel reads what write_kv wrote
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_matches_the_pytorch_backend_through_decode(dtype):
    """Keys written by write_kv (column layout) and read by the kernel give PyTorch's attention."""
    kv_heads, groups, head_dim, block_size, num_blocks = 2, 3, 32, 16, 12
    geometry = CacheGeometry(block_size, num_blocks, kv_heads, groups, head_dim, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tables = [[3, 7, 1], [0, 11], [5]]
    prompt_lens = [40, 20, 9]
    backends = {"torch": TorchPagedAttention(), "cpu": CpuPagedAttention()}
    caches = {name: (torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype),
                     torch.zeros(kv_heads, num_blocks, block_size, head_dim, dtype=dtype)) for name in backends}
    steps = [(prompt_lens, [0, 0, 0]), ([1, 1, 1], prompt_lens)]  # a prefill, then one decode step
    outputs = {name: [] for name in backends}
    for query_lens, context_lens in steps:
        tokens = sum(query_lens)
        qkv = torch.randn(tokens, (kv_heads * groups + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
        q = qkv[:, : kv_heads * groups * head_dim].view(tokens, -1, head_dim)
        k = qkv[:, kv_heads * groups * head_dim : (kv_heads * groups + kv_heads) * head_dim].view(tokens, -1, head_dim)
        v = qkv[:, (kv_heads * groups + kv_heads) * head_dim :].view(tokens, -1, head_dim)
        for name, backend in backends.items():
            metadata = backend.build_metadata(query_lens, context_lens, tables, geometry)
            outputs[name].append(backend.forward(q, k, v, *caches[name], metadata, head_dim**-0.5))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(outputs["cpu"], outputs["torch"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(caches["cpu"][1], caches["torch"][1], rtol=0, atol=0)  # values: the same rows


def test_write_kv_refuses_a_slot_past_the_cache():
    cache = torch.zeros(1, 2, 16, 32)
    k = torch.randn(1, 1, 32)
    with pytest.raises(RuntimeError, match="past the cache"):
        torch.ops.tokenmill.write_kv(k, k, cache, cache.clone(), torch.tensor([32]))


def test_model_on_fused_ops_matches_the_pytorch_path(tiny_llama_dir, monkeypatch):
    prompts = ["Once upon a time, in a kingdom by the sea", "Short"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    fused = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    _unfused(monkeypatch, norm, rotary, activation)
    plain = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64).generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].logprobs) == 16
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(lp_a))
            assert abs(lp_a[token].logprob - lp_b[token].logprob) < 1e-4
