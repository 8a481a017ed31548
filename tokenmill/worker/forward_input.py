"""What one forward pass computes, the same on every tensor-parallel rank, and its wire form.

Rank 0 derives it from the step's SchedulerOutput; workers receive it as JSON (never a pickle)
and refuse a message that does not parse into exactly this shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenmill.engine.scheduler_output import SchedulerOutput


class MalformedStepError(ValueError):
    """A step message that is not a valid ForwardInput."""


@dataclass
class ForwardInput:
    """The sequences of one step, in batch order."""

    token_ids: list[list[int]]  # new tokens of each sequence
    num_computed_tokens: list[int]  # tokens each already has in the KV cache
    block_tables: list[list[int]]  # each sequence's KV blocks
    needs_logits: list[bool]  # sequences whose last new token's logits are wanted

    @classmethod
    def from_scheduler_output(cls, output: SchedulerOutput) -> ForwardInput:
        seqs = output.sequences
        return cls([s.token_ids for s in seqs], [s.num_computed_tokens for s in seqs],
                   [s.block_ids for s in seqs], [s.sampling is not None for s in seqs])

    @property
    def num_sequences(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> bytes:
        return json.dumps([self.token_ids, self.num_computed_tokens, self.block_tables, self.needs_logits],
                          separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> ForwardInput:
        """Parse and check a step message; raises MalformedStepError on anything unexpected."""
        try:
            fields = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedStepError(f"step message is not JSON: {exc}") from None
        if not isinstance(fields, list) or len(fields) != 4 or not all(isinstance(f, list) for f in fields):
            raise MalformedStepError("step message must be four lists")
        token_ids, num_computed, block_tables, needs_logits = fields
        if not token_ids or not len(token_ids) == len(num_computed) == len(block_tables) == len(needs_logits):
            raise MalformedStepError("step message lists must be non-empty and of equal length")
        if not all(_is_int_list(t) and t for t in token_ids) or not _is_int_list(num_computed) \
                or not all(_is_int_list(t) and t for t in block_tables) \
                or not all(isinstance(b, bool) for b in needs_logits):
            raise MalformedStepError("step message fields have the wrong types")
        return cls(token_ids, num_computed, block_tables, needs_logits)


def _is_int_list(values: list) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)
