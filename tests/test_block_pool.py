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


def _computed(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> Request:
    """Allocate slots for the whole prompt, 'compute' it, and register its full blocks."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(request)
    return request


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60), st.integers(1, 12))
def test_pool_refcounts(ops, num_blocks):
    pool = BlockPool(num_blocks)
    held: list[list] = []
    for is_alloc, n in ops:
        if is_alloc:
            free_before = pool.num_free_blocks
            blocks = pool.allocate(n)
            if n > free_before:
                assert blocks is None and pool.num_free_blocks == free_before  # refused, nothing taken
            else:
                assert blocks is not None and len(blocks) == n  # an allocation that fits succeeds
                assert all(b.ref_cnt == 1 and b.block_id not in pool.free_queue for b in blocks)
                assert pool.num_free_blocks == free_before - n
                held.append(blocks)
        elif held:
            pool.free(held.pop(n % len(held)))
        in_use = [b.block_id for blocks in held for b in blocks]
        assert len(in_use) == len(set(in_use))  # no block handed out twice
        assert pool.num_free_blocks + len(in_use) == num_blocks
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free_blocks == num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_prefix_hit_reuses_blocks_and_freed_blocks_stay_cached():
    kv = KVCacheManager(8, 4)
    a = _computed(kv, _request("a", list(range(10))))
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
    _computed(kv, _request("a", list(range(8))))
    hits, num_tokens = kv.get_computed_blocks(_request("b", list(range(8))))
    assert num_tokens == 4 and len(hits) == 1


def test_blocks_enter_the_cache_only_once_computed():
    kv = KVCacheManager(8, 4)
    a = _request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is not None  # slots given, forward not run yet
    assert kv.pool.cached == {} and kv.get_computed_blocks(_request("b", list(range(12))))[1] == 0
    a.num_computed_tokens = 6  # a chunk of 6 tokens ran: only the first block is complete
    kv.cache_computed_blocks(a)
    assert len(kv.pool.cached) == 1 and kv.get_computed_blocks(_request("c", list(range(12))))[1] == 4
    kv.check_integrity()


def test_everything_colliding_never_returns_wrong_blocks(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda key, parent, tokens: b"42")  # all collide
    kv = KVCacheManager(8, 4)
    _computed(kv, _request("a", [1, 2, 3, 4, 5]))
    hits, num_tokens = kv.get_computed_blocks(_request("b", [9, 9, 9, 9, 5]))
    assert hits == [] and num_tokens == 0


def test_same_block_tokens_under_another_prefix_are_never_shared(monkeypatch):
    # A hash that forgets the parent: block [5, 6, 7, 8] hashes the same after any prefix.
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda key, parent, tokens: repr(tokens).encode())
    kv = KVCacheManager(16, 4)
    after_ones = _computed(kv, _request("a", [1, 1, 1, 1, 5, 6, 7, 8, 0]))
    _computed(kv, _request("c", [9, 9, 9, 9, 0, 0, 0, 0, 0]))
    # [9, 9, 9, 9] is a real hit; [5, 6, 7, 8] is cached, but its KV was computed after [1, 1, 1, 1]
    hits, num_tokens = kv.get_computed_blocks(_request("d", [9, 9, 9, 9, 5, 6, 7, 8, 0]))
    assert num_tokens == 4 and [h.block_id for h in hits] == kv.block_ids("c")[:1]
    # the same chain still hits in full
    hits, num_tokens = kv.get_computed_blocks(_request("e", [1, 1, 1, 1, 5, 6, 7, 8, 3]))
    assert num_tokens == 8 and [h.block_id for h in hits] == kv.block_ids(after_ones.request_id)[:2]


def test_a_reused_parent_invalidates_its_children(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda key, parent, tokens: repr(tokens).encode())
    kv = KVCacheManager(2, 4)
    a = _computed(kv, _request("a", [1, 1, 1, 1, 5, 6, 7, 8]))
    first, second = kv.req_blocks["a"]
    kv.free(a)  # the tail goes first in the LRU queue, then the first block
    kv.pool.free_queue.move_to_end(second.block_id)  # make the *parent* the next one evicted
    b = _computed(kv, _request("b", [2, 2, 2, 2]))
    assert kv.block_ids("b") == [first.block_id]
    # the same first block id now holds [2, 2, 2, 2]; [5, 6, 7, 8] after it must not be found
    kv.free(b)
    hits, _ = kv.get_computed_blocks(_request("c", [2, 2, 2, 2, 5, 6, 7, 8, 0]))
    assert [h.block_id for h in hits] == [first.block_id]
    kv.check_integrity()


def test_hashes_are_keyed_content_hashes():
    a, b = KVCacheManager(4, 4, hash_key=b"k" * 16), KVCacheManager(4, 4, hash_key=b"k" * 16)
    r1, r2 = _request("x", [1, 2, 3, 4, 5]), _request("y", [1, 2, 3, 4, 6])
    a.get_computed_blocks(r1)
    b.get_computed_blocks(r2)
    assert r1.block_hashes == r2.block_hashes  # same key, same block content: same hash in any process
    other = _request("z", [1, 2, 3, 4, 5])
    KVCacheManager(4, 4).get_computed_blocks(other)  # a random per-process key
    assert other.block_hashes != r1.block_hashes


def test_lru_eviction_takes_least_recently_freed_first():
    kv = KVCacheManager(4, 2)
    old = _computed(kv, _request("old", [1, 2, 3]))
    new = _computed(kv, _request("new", [7, 8, 9]))  # the pool is full
    kv.free(old)
    kv.free(new)
    filler = _request("filler", [5, 5, 5])
    kv.allocate_slots(filler, 3)  # takes 2 blocks: 'old' content goes first
    assert kv.get_computed_blocks(_request("x", [1, 2, 3]))[1] == 0
    assert kv.get_computed_blocks(_request("y", [7, 8, 9]))[1] == 2


def test_cached_prefixes_keep_their_blocks_within_the_reserve():
    """Distinct prompts one after another (several system prompts): each one's blocks stay cached
    while fewer than the reserve were ever used, so every prompt hits on its return."""
    kv = KVCacheManager(64, 4)  # reserve: 16 blocks
    prompts = [[100 * p + i for i in range(12)] for p in range(4)]  # 3 blocks each
    for round_ in range(2):
        for p, prompt in enumerate(prompts):
            blocks, num_cached = kv.get_computed_blocks(_request(f"q{round_}{p}", prompt))
            assert num_cached == (0 if round_ == 0 else 8)  # all but the last block: one token is recomputed
            kv.free(_computed(kv, _request(f"r{round_}{p}", prompt)))
    kv.check_integrity()


def test_freed_blocks_are_reused_before_fresh_ones():
    """Past the reserve, the pool's memory stays what was in use at once: a freed block (even a
    cached one) is handed out again before a never-used block is touched."""
    kv = KVCacheManager(8, 2, prefix_cache_reserve=0.25)  # 2 blocks
    first = _computed(kv, _request("first", [1, 2, 3, 4, 5]))
    used = {b.block_id for b in kv.req_blocks["first"]}
    kv.free(first)
    assert kv.get_computed_blocks(_request("again", [1, 2, 3, 4, 5]))[1] == 4  # cached while nothing needs them
    other = _request("other", [9, 9, 9, 9, 9])
    kv.allocate_slots(other, 5)
    assert {b.block_id for b in kv.req_blocks["other"]} == used  # the freed blocks, not fresh ones
    assert kv.pool.next_fresh == len(used) == 3
    assert kv.get_computed_blocks(_request("late", [1, 2, 3, 4, 5]))[1] == 0  # evicted instead
    kv.check_integrity()


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False)
    _computed(kv, _request("a", list(range(10))))
    assert kv.get_computed_blocks(_request("b", list(range(10)))) == ([], 0)
    assert kv.pool.cached == {}
