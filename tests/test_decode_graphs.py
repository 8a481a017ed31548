"""Decode steps on padded, fixed-shape buffers (what CUDA graphs replay), checked on the CPU.

Off CUDA the graphs are EagerReplay: the same step function on the same buffers, so these tests
cover everything around the capture (padding rows, the scratch block, the shape buckets, the
attention on fixed shapes) against the eager path. The captures themselves are in test_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import CacheGeometry, TorchPagedAttention
from tokenmill.layers.padded_decode_attention import (
    PaddedDecodeAttention,
    keys_and_values,
    padded_decode_inputs,
    padded_decode_metadata,
)
from tokenmill.worker import decode_graphs
from tokenmill.worker.decode_graphs import GRAPH_BATCH_SIZES, padded_batch_size, padded_block_count, uses_decode_graphs

from conftest import TINY_ARCHS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = ["The quick brown fox", "In the beginning there was only the sea, and the sea was", "A", "Once upon",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Hello", "Why is the sky", "x y z"]


def test_shape_buckets():
    assert [padded_batch_size(n) for n in (1, 2, 3, 5, 9, 17, 25, 33, 200, 256)] == \
        [1, 2, 4, 8, 16, 24, 32, 48, 224, 256]
    assert [padded_block_count(n) for n in (1, 2, 3, 4, 5, 9, 100)] == [1, 2, 4, 4, 8, 16, 128]
    assert GRAPH_BATCH_SIZES == tuple(sorted(GRAPH_BATCH_SIZES))


def test_inputs_cover_each_new_token_and_pad_on_the_scratch_block():
    inputs = padded_decode_inputs([11, 12], [0, 35], [[3], [7, 1, 4, 9]], batch=4, num_blocks=4, block_size=16,
                                  scratch_block=99)
    assert inputs.tolist() == [
        [11, 0, 3, 99, 99, 99],  # position 0: its first block only
        [12, 35, 7, 1, 4, 99],  # position 35 lies in its third block; the fourth is not read
        [0, 0, 99, 99, 99, 99],  # padding rows
        [0, 0, 99, 99, 99, 99],
    ]


def _random_cache(geometry: CacheGeometry) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    shape = (2, geometry.num_kv_heads, geometry.num_blocks, geometry.block_size, geometry.head_dim)
    return torch.randn(shape, generator=gen, dtype=torch.float32)


@pytest.mark.parametrize("one_storage", [True, False])
def test_padded_attention_matches_the_paged_backend(one_storage):
    """Ragged contexts over scattered blocks, padded to 8 rows x 8 blocks: the real rows' outputs
    and cache writes equal TorchPagedAttention's; padding touches only the scratch block. Keys and
    values in one storage (the runner's pool) are gathered together, else one by one."""
    kv_heads, groups, head_dim, block_size, scratch = 2, 3, 16, 4, 20
    geometry = CacheGeometry(block_size, 21, kv_heads, groups, head_dim, torch.float32, torch.device("cpu"))
    positions = [0, 5, 12, 26, 3]  # the new token's position: context length before it
    tables = [[4], [9, 2], [0, 13, 7, 19], [1, 3, 5, 6, 8, 10, 11], [15]]
    tokens = [1, 2, 3, 4, 5]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, kv_heads * groups, head_dim, generator=gen)
    k, v = (torch.randn(5, kv_heads, head_dim, generator=gen) for _ in range(2))

    ref_cache = _random_cache(geometry)
    reference = TorchPagedAttention()
    metadata = reference.build_metadata([1] * 5, positions, tables, geometry)
    expected = reference.forward(q, k, v, ref_cache[0], ref_cache[1], metadata, scale=0.25)

    cache = _random_cache(geometry)
    inputs = padded_decode_inputs(tokens, positions, tables, batch=8, num_blocks=8, block_size=block_size,
                                  scratch_block=scratch)
    padded = padded_decode_metadata(inputs, geometry)
    assert padded.input_ids[:5].tolist() == tokens and padded.positions[:5].tolist() == positions
    pad = lambda t: torch.cat([t, t[:1].expand(3, *t.shape[1:]) * 7.0])  # noqa: E731 - padding rows hold junk
    k_cache, v_cache = (cache[0], cache[1]) if one_storage else (cache[0].clone(), cache[1].clone())
    assert (keys_and_values(k_cache, v_cache) is not None) == one_storage
    out = PaddedDecodeAttention().forward(pad(q), pad(k), pad(v), k_cache, v_cache, padded, scale=0.25)
    cache = torch.stack([k_cache, v_cache])
    assert out.shape == (8, kv_heads * groups * head_dim)
    torch.testing.assert_close(out[:5], expected, rtol=1e-5, atol=1e-5)
    untouched = [b for b in range(geometry.num_blocks) if b != scratch]
    torch.testing.assert_close(cache[:, :, untouched], ref_cache[:, :, untouched], rtol=0, atol=0)
    assert torch.isfinite(out[5:]).all()


def _graph_llm(monkeypatch, path, **kwargs) -> LLM:
    monkeypatch.setattr(decode_graphs, "uses_decode_graphs", lambda device, enforce_eager: not enforce_eager)
    return LLM(model=str(path), dtype="float32", **kwargs)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_replayed_decode_steps_give_the_eager_tokens(arch, tiny_model_dirs, monkeypatch):
    eager = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", num_kv_blocks=128)
    expected = [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = _graph_llm(monkeypatch, tiny_model_dirs[arch], num_kv_blocks=128)
    runner = llm.engine.executor.runner
    assert runner.kv_cache.shape[3] == 129 and runner.decode_graphs.scratch_block == 128
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == expected
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]  # batch 3 -> 4
    assert got == expected[:3]
    graphs = runner.decode_graphs
    # two batch sizes, contexts growing over block buckets
    assert graphs.num_replays >= 2 * (GREEDY.max_tokens - 1) and len(graphs.steps) >= 3
    assert llm.stats().kv_cache.num_used_blocks == 0


def test_replayed_decode_under_preemption_chunking_and_prefix_hits(tiny_llama_dir, monkeypatch):
    alone_llm = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128)
    alone = [alone_llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    tight = _graph_llm(monkeypatch, tiny_llama_dir, num_kv_blocks=14, max_num_batched_tokens=9)
    together = tight.generate(PROMPTS + PROMPTS[:3], GREEDY, use_tqdm=False)  # repeats: prefix hits
    assert tight.stats().num_preemptions > 0 and tight.engine.executor.runner.decode_graphs.num_replays > 0
    assert [o.outputs[0].token_ids for o in together] == alone + alone[:3]
    assert tight.stats().kv_cache.num_used_blocks == 0


def test_enforce_eager_keeps_graphs_off(tiny_llama_dir, monkeypatch):
    llm = _graph_llm(monkeypatch, tiny_llama_dir, num_kv_blocks=32, enforce_eager=True)
    runner = llm.engine.executor.runner
    assert runner.decode_graphs is None and runner.kv_cache.shape[3] == 32


def test_graphs_are_the_default_on_cuda_only():
    assert uses_decode_graphs(torch.device("cuda"), enforce_eager=False)
    assert not uses_decode_graphs(torch.device("cuda"), enforce_eager=True)
    assert not uses_decode_graphs(torch.device("cpu"), enforce_eager=False)
