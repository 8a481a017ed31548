"""Which data-parallel replica a request goes to.

cache_aware: the replica that holds the longest prefix of the prompt, in whole KV blocks; ties and
misses go to the least loaded (tokens of its requests in flight: prompts + max_tokens). What each
replica holds is tracked here, from what was sent to it: the prompt's block hashes (the engines'
own `hash_block`, under the deployment's key, so router and replicas name a prefix alike) in an
LRU as large as the replica's KV pool, as the replica's own free-block reuse is. round_robin: the
next replica that is up, for comparison.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache_manager import hash_block

POLICIES = ("cache_aware", "round_robin")


@dataclass
class ReplicaSlot:
    """What the router knows of one replica."""

    capacity_blocks: int
    up: bool = True
    load_tokens: int = 0
    blocks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # oldest first


class PrefixRouter:
    def __init__(self, capacities: list[int], block_size: int, hash_key: bytes, policy: str = "cache_aware") -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.replicas = [ReplicaSlot(capacity) for capacity in capacities]
        self.block_size = block_size
        self.hash_key = hash_key
        self.policy = policy
        self._next = 0

    def block_hashes(self, prompt_token_ids: list[int]) -> list[bytes]:
        hashes: list[bytes] = []
        size = self.block_size
        for start in range(0, len(prompt_token_ids) - size + 1, size):
            hashes.append(hash_block(self.hash_key, hashes[-1] if hashes else None,
                                     tuple(prompt_token_ids[start:start + size])))
        return hashes

    def cached_blocks(self, replica: int, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt the replica holds (as far as the router knows)."""
        held = self.replicas[replica].blocks
        count = 0
        for block in hashes:
            if block not in held:
                break
            count += 1
        return count

    def choose(self, prompt_token_ids: list[int]) -> tuple[int, list[bytes]] | None:
        """(replica, the prompt's block hashes); None when no replica is up."""
        up = [i for i, slot in enumerate(self.replicas) if slot.up]
        if not up:
            return None
        if self.policy == "round_robin":
            choice = min(up, key=lambda i: (i - self._next) % len(self.replicas))
            self._next = choice + 1
            return choice, []
        hashes = self.block_hashes(prompt_token_ids)
        choice = max(up, key=lambda i: (self.cached_blocks(i, hashes), -self.replicas[i].load_tokens, -i))
        return choice, hashes

    def sent(self, replica: int, hashes: list[bytes], tokens: int) -> None:
        """A request went to `replica`: its prompt's blocks are (about to be) cached there."""
        slot = self.replicas[replica]
        slot.load_tokens += tokens
        for block in hashes:
            slot.blocks[block] = None
            slot.blocks.move_to_end(block)
        while len(slot.blocks) > slot.capacity_blocks:
            slot.blocks.popitem(last=False)

    def done(self, replica: int, tokens: int) -> None:
        self.replicas[replica].load_tokens -= tokens

    def set_up(self, replica: int, up: bool) -> None:
        slot = self.replicas[replica]
        slot.up = up
        slot.load_tokens = 0
        slot.blocks.clear()  # a restarted replica starts with an empty cache
