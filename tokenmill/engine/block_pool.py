"""Block pool: KV blocks, their reference counts, the free queue and the prefix-hash map.

Freed blocks sit in an LRU queue. A freed block keeps its cached content (and its hash
entry) until the pool hands it out again, so a later request with the same prefix can
revive it; eviction takes the least recently freed block first. The KV pool's memory becomes
resident only as pages are first written (worker/model_runner.py), so which block to hand out
is also a memory decision: never-used blocks are handed out first until `num_reserved_blocks`
have been used (room for cached prefixes: shared system prompts, earlier turns of chats), freed
ones first after that. Resident KV stays at max(peak in use at once, the reserve).

A cached block can only be found through its whole chain: a hit needs the block's own token
ids and its parent block as it was when the block was computed (block id and generation; the
generation changes whenever a block's content is replaced). So two prefixes that collide on
the hash, or a parent that was evicted and reused, can never hand out KV of another prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    """One block of block_size token slots in every layer's KV cache."""

    block_id: int
    ref_cnt: int = 0
    generation: int = 0  # bumped each time the block is handed out for new content
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # kept to re-check a hash hit
    parent: tuple[int, int] | None = None  # (block id, generation) of the previous block of its chain

    @property
    def ref(self) -> tuple[int, int]:
        """This block's content as a child refers to it."""
        return self.block_id, self.generation


class BlockPool:
    """Owns every KVBlock; hands them out, takes them back, and indexes cached full blocks."""

    def __init__(self, num_blocks: int, num_reserved_blocks: int = 0) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.num_reserved_blocks = min(num_reserved_blocks, num_blocks)  # fresh before freed until this many were used
        self.free_queue: OrderedDict[int, None] = OrderedDict()  # handed out before, freed since; LRU first
        self.next_fresh = 0  # blocks [next_fresh, num_blocks) were never handed out
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.blocks) - self.next_fresh

    def is_free(self, block_id: int) -> bool:
        return block_id in self.free_queue or block_id >= self.next_fresh

    def allocate(self, count: int) -> list[KVBlock] | None:
        """Take `count` blocks: never-used ones while fewer than num_reserved_blocks were ever used,
        then from the front of the free queue (evicting their cached content), then never-used ones."""
        if count > self.num_free_blocks:
            return None
        taken = []
        for _ in range(count):
            if self.free_queue and self.next_fresh >= self.num_reserved_blocks:
                block_id, _ = self.free_queue.popitem(last=False)
            else:
                block_id, self.next_fresh = self.next_fresh, self.next_fresh + 1
            block = self.blocks[block_id]
            self._evict(block)
            block.generation += 1
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

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...], parent: KVBlock | None) -> KVBlock | None:
        """The cached block with this hash, only if its token ids and its parent really match."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent != (None if parent is None else parent.ref):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...], parent: KVBlock | None) -> None:
        """Register a full, computed block under its hash (first writer wins for identical content)."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        block.parent = None if parent is None else parent.ref
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent = None, None, None
