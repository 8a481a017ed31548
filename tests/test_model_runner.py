"""The model runner's KV pool: zero, and resident only where written."""

from __future__ import annotations

import gc

import torch

from tokenmill.platform import release_free_memory
from tokenmill.worker.model_runner import zeros_on_demand


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_kv_pool_is_zero_and_resident_only_where_written():
    gc.collect()
    release_free_memory()  # RSS is read after trims only: what earlier tests freed must not count
    before = _rss_mb()
    pool = zeros_on_demand((4, 2, 8192, 2048), torch.bfloat16)  # 256 MiB
    gc.collect()  # the mapping must outlive the function's own reference to it
    assert pool.shape == (4, 2, 8192, 2048) and pool.dtype == torch.bfloat16
    assert _rss_mb() - before < 32
    assert float(pool[1].float().abs().sum()) == 0.0  # reading maps the zero page, not new memory
    release_free_memory()  # the freed temporaries: glibc may keep them resident (its mmap threshold moves)
    assert _rss_mb() - before < 32 + 64  # (+ the float copy's own 64 MiB, at most)
    pool[0].fill_(1.5)  # a quarter of it
    grown = _rss_mb() - before
    assert 60 <= grown < 32 + 64 + 80
    assert float(pool[0, 1, 5, 7]) == 1.5 and float(pool[2].float().sum()) == 0.0
