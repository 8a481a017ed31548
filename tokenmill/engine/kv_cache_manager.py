"""KV cache manager: block tables per request, slot allocation, prefix reuse, stats."""

from __future__ import annotations

import hashlib
import secrets
from array import array
from dataclasses import dataclass

from tokenmill.engine.block_pool import BlockPool, KVBlock
from tokenmill.engine.request import Request


@dataclass
class KVCacheStats:
    """Numbers the engine exposes about its KV cache."""

    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    usage: float  # used / total
    num_slots_allocated: int
    num_tokens_stored: int
    waste: float  # 1 - stored / allocated
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found


def hash_block(key: bytes, parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """A block's content hash: keyed BLAKE2b over its parent's hash and its own token ids, so it
    names the whole prefix up to the block's end."""
    digest = hashlib.blake2b(parent_hash or b"", key=key, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    """Maps requests to blocks. allocate_slots() returns None, changing nothing, when the pool is short.

    Full blocks enter the prefix cache only once the step that computed them has run
    (cache_computed_blocks), never at allocation: a failed step leaves no hash of unwritten KV.
    hash_key keys the block hashes (random per process unless given).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_key: bytes | None = None, prefix_cache_reserve: float = 0.25) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_key = hash_key or secrets.token_bytes(16)
        reserved = int(num_blocks * prefix_cache_reserve) if enable_prefix_caching else 0
        self.pool = BlockPool(num_blocks, reserved)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_num_tokens: dict[str, int] = {}  # tokens that have a slot
        self.req_num_cached_blocks: dict[str, int] = {}  # leading blocks registered in the hash map
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            tokens = tuple(request.all_token_ids[i * size : (i + 1) * size])
            hashes.append(hash_block(self.hash_key, hashes[-1] if hashes else None, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a new request, as (blocks, number of tokens).

        At least one token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        size = self.block_size
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            tokens = tuple(request.all_token_ids[i * size : (i + 1) * size])
            block = self.pool.lookup(hashes[i], tokens, hits[-1] if hits else None)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * size
        return hits, len(hits) * size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Give the request slots for num_new_tokens more tokens (after its computed ones).

        computed_blocks: prefix-cache hits of a newly admitted request.
        Returns the request's whole block list, or None if the pool cannot supply it.
        """
        computed_blocks = computed_blocks or []
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_required = self.blocks_needed(total_tokens) - len(blocks) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)  # leave the free queue
        num_required = max(0, num_required)
        if num_required + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(computed_blocks)
        new_blocks = self.pool.allocate(num_required) or []
        blocks = self.req_blocks.setdefault(rid, blocks)
        blocks.extend(computed_blocks)
        blocks.extend(new_blocks)
        self.req_num_tokens[rid] = total_tokens
        if computed_blocks:  # the hits are registered already
            self.req_num_cached_blocks[rid] = len(computed_blocks)
        return blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV has been written (its num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        start = self.req_num_cached_blocks.get(rid, 0)
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if blocks is None or num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        size = self.block_size
        for i in range(start, num_full):
            tokens = tuple(request.all_token_ids[i * size : (i + 1) * size])
            self.pool.cache(blocks[i], hashes[i], tokens, blocks[i - 1] if i else None)
        self.req_num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Return every block of the request (tail first, so the tail is evicted first)."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.pool.free(list(reversed(blocks)))
        self.req_num_tokens.pop(rid, None)
        self.req_num_cached_blocks.pop(rid, None)

    def stats(self) -> KVCacheStats:
        """O(requests): the server reads these after every step."""
        used = self.pool.num_blocks - self.pool.num_free_blocks
        slots = used * self.block_size
        # A request holds exactly the blocks its tokens need, so only its last block can be partial,
        # and only full blocks are ever shared: each extra owner of a block counts one full block twice.
        num_owned = sum(len(blocks) for blocks in self.req_blocks.values())
        stored = sum(self.req_num_tokens.values()) - (num_owned - used) * self.block_size
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.pool.num_free_blocks,
            usage=used / max(1, self.pool.num_blocks),
            num_slots_allocated=slots,
            num_tokens_stored=stored,
            waste=0.0 if slots == 0 else 1.0 - stored / slots,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def check_integrity(self) -> None:
        """Ref counts equal the number of owners; free blocks are exactly those with none."""
        owners: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for block in blocks:
                owners[block.block_id] = owners.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            expected = owners.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise RuntimeError(f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected} owners")
            if (block.ref_cnt == 0) != self.pool.is_free(block.block_id):
                raise RuntimeError(f"block {block.block_id}: free-queue membership disagrees with ref_cnt")
        for block_hash, block in self.pool.cached.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"hash map entry points at block {block.block_id} with another hash")
            if block.parent is not None and self.pool.blocks[block.parent[0]].generation < block.parent[1]:
                raise RuntimeError(f"block {block.block_id} names a parent generation that never existed")
