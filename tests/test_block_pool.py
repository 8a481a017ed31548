"""Block pool and KV cache manager: ref counts, LRU eviction, prefix hits, collisions, stats."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine import kv_cache_manager
from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.sampling_params import SamplingParams


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), max_tokens=4, seed=0, eos_token_ids=frozenset())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60), st.integers(1, 12))
def test_pool_refcounts(ops, num_blocks):
    pool = BlockPool(num_blocks)
    held = []
    for is_alloc, n in ops:
        if is_alloc:
            blocks = pool.allocate(n)
            if n > pool.num_free_blocks + (len(blocks) if blocks else 0):
                assert blocks is None
            if blocks:
                held.append(blocks)
        elif held:
            pool.free(held.pop(n % len(held)))
        assert pool.num_free_blocks + sum(len(b) for b in held) == num_blocks
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_prefix_hit_reuses_blocks_and_freed_blocks_stay_cached():
    kv = KVCacheManager(8, 4)
    a = _request("a", list(range(10)))
    assert kv.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    kv.free(a)
    assert kv.pool.num_free_blocks == 8
    b = _request("b", list(range(9)) + [99])
    hits, num_tokens = kv.get_computed_blocks(b)
    assert num_tokens == 8 and len(hits) == 2
    assert kv.allocate_slots(b, 2, hits) is not None
    assert kv.block_ids("b")[:2] == [h.block_id for h in hits]
    stats = kv.stats()
    assert stats.num_used_blocks == 3 and stats.num_tokens_stored == 10 and stats.num_slots_allocated == 12
    assert abs(stats.waste - (1 - 10 / 12)) < 1e-9
    assert stats.prefix_cache_hits == 8 and stats.prefix_cache_queries == 10
    kv.check_integrity()


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(8, 4)
    a = _request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    hits, num_tokens = kv.get_computed_blocks(_request("b", list(range(8))))
    assert num_tokens == 4 and len(hits) == 1


def test_hash_collision_never_returns_wrong_blocks(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, tokens: 42)  # everything collides
    kv = KVCacheManager(8, 4)
    kv.allocate_slots(_request("a", [1, 2, 3, 4, 5]), 5)
    hits, num_tokens = kv.get_computed_blocks(_request("b", [9, 9, 9, 9, 5]))
    assert hits == [] and num_tokens == 0


def test_lru_eviction_takes_least_recently_freed_first():
    kv = KVCacheManager(4, 2)
    old, new = _request("old", [1, 2, 3]), _request("new", [7, 8, 9])
    kv.allocate_slots(old, 3)
    kv.free(old)
    kv.allocate_slots(new, 3)
    kv.free(new)
    filler = _request("filler", [5, 5, 5])
    kv.allocate_slots(filler, 3)  # takes 2 blocks: 'old' content goes first
    assert kv.get_computed_blocks(_request("x", [1, 2, 3]))[1] == 0
    assert kv.get_computed_blocks(_request("y", [7, 8, 9]))[1] == 2


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    kv.allocate_slots(_request("a", list(range(10))), 10)
    assert kv.get_computed_blocks(_request("b", list(range(10)))) == ([], 0)
    assert kv.pool.cached == {}
