"""The C++ decode-attention kernel against a float64 reference and against the PyTorch backend."""

from __future__ import annotations

import shutil

import pytest
import torch

from tokenmill.layers import attention
from tokenmill.layers.attention import CacheGeometry, StepLayout, TorchPagedAttention
from tokenmill.layers.cpu_attention import (
    CpuPagedAttention,
    KernelPrefillChunks,
    default_attention_backend,
    kernel_supports,
    load_cpu_kernels,
)

AVX512 = "AVX512" in torch.backends.cpu.get_cpu_capability()
needs_kernel = pytest.mark.skipif(not AVX512, reason="the CPU kernel needs AVX-512")


@pytest.mark.skipif(not (AVX512 and shutil.which("c++")), reason="no AVX-512 or no C++ compiler")
def test_kernel_builds_where_it_can():
    # Guards the fallback: on a machine that can build the kernel, the engine must not silently lose it.
    assert load_cpu_kernels()
    backend = default_attention_backend(torch.device("cpu"), torch.bfloat16, head_dim=64, num_query_groups=3)
    assert isinstance(backend, CpuPagedAttention)


def test_fallback_when_disabled_or_unsupported(monkeypatch):
    cpu = torch.device("cpu")
    assert not kernel_supports(head_dim=24, num_query_groups=2, dtype=torch.float32)
    assert not kernel_supports(head_dim=64, num_query_groups=16, dtype=torch.float32)
    assert type(default_attention_backend(cpu, torch.float32, head_dim=24, num_query_groups=2)) is TorchPagedAttention
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    assert type(default_attention_backend(cpu, torch.bfloat16, 64, 3)) is TorchPagedAttention


def test_build_failure_falls_back_with_one_line(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken_build(**kwargs):
        raise RuntimeError("Error building extension 'tokenmill_cpu_kernels'\n(the compiler's log)")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(cpp_extension, "load", broken_build)
    assert load_cpu_kernels.__wrapped__() is False  # the cached function, called afresh
    assert "using the PyTorch path: Error building extension" in caplog.text
    assert "compiler's log" not in caplog.text


class Scenario:
    """Sequences with known per-token q/k/v, their blocks scattered over a shared cache."""

    def __init__(self, seq_lens, num_kv_heads, groups, head_dim, block_size, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens, self.block_size, self.dtype = list(seq_lens), block_size, dtype
        self.scale = head_dim**-0.5
        heads = num_kv_heads * groups
        self.q = [torch.randn(n, heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.k = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
        counts = [(n + block_size - 1) // block_size for n in seq_lens]
        num_blocks = sum(counts) + 5
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
        self.geometry = CacheGeometry(block_size, num_blocks, num_kv_heads, groups, head_dim, dtype, torch.device("cpu"))
        self.cache_shape = (num_kv_heads, num_blocks, block_size, head_dim)

    def run(self, backend, steps):
        """steps: per step, a list of (sequence, number of new tokens); returns each step's output."""
        k_cache = torch.zeros(self.cache_shape, dtype=self.dtype)
        v_cache = torch.zeros(self.cache_shape, dtype=self.dtype)
        done = [0] * len(self.seq_lens)
        outputs = []
        for step in steps:
            spans = [(i, done[i], done[i] + n) for i, n in step]
            metadata = backend.build_metadata(
                [n for _, n in step], [done[i] for i, _ in step], [self.tables[i] for i, _ in step], self.geometry
            )
            q, k, v = (torch.cat([t[i][a:b] for i, a, b in spans]) for t in (self.q, self.k, self.v))
            outputs.append(backend.forward(q, k, v, k_cache, v_cache, metadata, self.scale))
            for i, n in step:
                done[i] += n
        return outputs

    def reference_last_token(self):
        """Float64 attention of each sequence's last token over all of its tokens."""
        outs = []
        for q, k, v in zip(self.q, self.k, self.v):
            kv_heads = k.shape[1]
            queries = q[-1].double().view(kv_heads, -1, q.shape[-1])  # [kv_heads, groups, head_dim]
            keys, values = k.double().transpose(0, 1), v.double().transpose(0, 1)  # [kv_heads, n, head_dim]
            probs = torch.softmax(queries @ keys.transpose(1, 2) * self.scale, dim=-1)
            outs.append((probs @ values).reshape(-1))
        return torch.stack(outs)


CASES = [
    # (num_kv_heads, groups, head_dim, block_size, dtype, atol)
    (3, 3, 64, 16, torch.bfloat16, 2e-2),  # the default model's shape
    (2, 2, 16, 16, torch.float32, 1e-5),  # the tiny test models
    (1, 8, 128, 32, torch.float16, 5e-3),
    (2, 1, 48, 8, torch.bfloat16, 2e-2),  # head_dim with a 16-wide tail, blocks shorter than 16 tokens
    (4, 2, 32, 16, torch.float32, 1e-5),
]


@needs_kernel
@pytest.mark.parametrize("num_kv_heads,groups,head_dim,block_size,dtype,atol", CASES)
def test_decode_matches_reference(num_kv_heads, groups, head_dim, block_size, dtype, atol):
    """Contexts written by a prefill step (the backend's own key layout), then one decode step."""
    assert load_cpu_kernels()
    seq_lens = [2, 15, 16, 17, 33, 100, 257, 6]
    scenario = Scenario(seq_lens, num_kv_heads, groups, head_dim, block_size, dtype)
    steps = [[(i, n - 1) for i, n in enumerate(seq_lens)], [(i, 1) for i in range(len(seq_lens))]]
    prefill, decode = scenario.run(CpuPagedAttention(), steps)
    torch_prefill, torch_decode = scenario.run(TorchPagedAttention(), steps)
    assert decode.dtype == dtype and decode.shape == (len(seq_lens), num_kv_heads * groups * head_dim)
    expected = scenario.reference_last_token()
    torch.testing.assert_close(decode.double(), expected, atol=atol, rtol=0)
    torch.testing.assert_close(torch_decode.double(), expected, atol=2 * atol, rtol=0)  # probs rounded to dtype
    # prefill reads the column-stored keys back through _gather_keys: same result as PyTorch's rows
    torch.testing.assert_close(prefill, torch_prefill, atol=0, rtol=0)


@needs_kernel
def test_mixed_steps_match_torch_backend():
    """Prefill chunks and decodes in the same steps, including a sequence's first token alone."""
    assert load_cpu_kernels()
    scenario = Scenario([40, 7, 90, 1, 33], 2, 3, 64, 16, torch.float32, seed=1)
    steps = [[(0, 39), (2, 50), (4, 13)], [(0, 1), (1, 7), (2, 40), (3, 1), (4, 20)]]
    for ours, theirs in zip(scenario.run(CpuPagedAttention(), steps), scenario.run(TorchPagedAttention(), steps)):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


@needs_kernel
def test_kernel_rejects_bad_shapes():
    assert load_cpu_kernels()
    q = torch.zeros(2, 4, 24)
    cache = torch.zeros(2, 4, 16, 24)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        torch.ops.tokenmill.paged_decode_qk(q, cache, torch.zeros(2, 1, dtype=torch.int64),
                                            torch.ones(2, dtype=torch.int64), 1.0, 16)


@pytest.mark.parametrize("backend_kind", ["kernel", "rows"])  # CpuPagedAttention; the AVX2 build's op's
def test_decode_only_metadata_equals_the_general_paths(backend_kind, monkeypatch):
    """Decode-only steps skip StepLayout (DecodeStepLayout): the same tensors as StepLayout and the
    backend's own decode bucket."""
    geometry = CacheGeometry(block_size=16, num_blocks=40, num_kv_heads=3, num_query_groups=3, head_dim=64,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
    if backend_kind == "rows":
        monkeypatch.setattr(attention, "_rows_kernel_available", lambda: True)
    backend = CpuPagedAttention() if backend_kind == "kernel" else TorchPagedAttention()
    context_lens = [0, 15, 16, 47, 200]
    block_tables = [[7], [3], [5, 9], [1, 2, 4], [i + 20 for i in range(13)]]
    fast = backend.build_metadata([1] * 5, context_lens, block_tables, geometry)
    step = StepLayout.build([1] * 5, context_lens, block_tables, geometry)
    bucket = backend._decode_bucket(step, step.members(decode=True), geometry)
    for name in ("positions", "write_index"):
        assert torch.equal(getattr(fast, name), getattr(step, name)), name
    if backend_kind == "kernel":
        assert torch.equal(fast.slots, step.write_index[:5])
    else:
        assert fast.decode.gather_index is None and bucket.gather_index is None and fast.decode.attn_mask is None
    assert fast.num_tokens == 5 and fast.prefill is None and fast.fresh_prefills == []
    for name in ("token_index", "block_table", "seq_lens"):
        assert torch.equal(getattr(fast.decode, name), getattr(bucket, name)), name
    assert fast.decode.context_len == bucket.context_len and fast.decode.covers_batch and bucket.covers_batch


def test_prefills_with_nothing_cached_skip_the_padded_bucket(monkeypatch):
    """Fresh chunks attend to their own keys (no bucket); chunks after cached tokens go to the paged
    kernel as they are (bf16 on AVX-512 CPUs), else into the padded bucket."""
    geometry = CacheGeometry(block_size=16, num_blocks=40, num_kv_heads=3, num_query_groups=3, head_dim=64,
                             dtype=torch.bfloat16, device=torch.device("cpu"))
    # a fresh prompt, a decode, a chunk after 32 cached tokens, another fresh prompt
    steps = ([5, 1, 7, 3], [0, 9, 32, 0], [[1], [2], [3, 4, 5], [6]], geometry)
    monkeypatch.setattr(attention, "_rows_kernel_available", lambda: False)  # as on the AVX-512 build
    monkeypatch.setattr(attention, "_prefill_kernel_available", lambda: True)
    md = CpuPagedAttention().build_metadata(*steps)
    assert md.fresh_prefills == [(0, 5), (13, 3)]  # (first flat token, tokens)
    assert isinstance(md.prefill, KernelPrefillChunks)  # only the chunk after cached tokens
    assert (md.prefill.starts.tolist(), md.prefill.lengths.tolist(), md.prefill.context_lens.tolist()) == ([6], [7], [32])
    assert md.prefill.block_table.tolist() == [[3, 4, 5]]
    assert md.decode is not None and not md.decode.covers_batch
    monkeypatch.setattr(attention, "_prefill_kernel_available", lambda: False)
    md = CpuPagedAttention().build_metadata(*steps)
    assert md.prefill is not None and md.prefill.valid.shape == (1, 7)
