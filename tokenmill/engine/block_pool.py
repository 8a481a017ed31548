"""Block pool: KV blocks, their reference counts, the free queue and the prefix-hash map.

Free blocks sit in an LRU queue. A freed block keeps its cached content (and its hash
entry) until the pool hands it out again, so a later request with the same prefix can
revive it; eviction takes the least recently freed block first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    """One block of block_size token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to re-check a hash hit


class BlockPool:
    """Owns every KVBlock; hands them out, takes them back, and indexes cached full blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock] | None:
        """Take `count` blocks from the front of the free queue, evicting their cached content."""
        if count > len(self.free_queue):
            return None
        taken = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the back of the free queue
        in the order given (callers pass a sequence's tail first, so it is evicted first)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix lookup."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block with this hash, only if its token ids really match."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its hash (first writer wins for identical content)."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, None
