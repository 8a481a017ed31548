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
    needs_logits: list[bool]  # sequences whose last new token's logits are wanted (to sample)
    # [offset, count]: new tokens of each sequence whose logits score prompt tokens ([0, 0]: none)
    prompt_logits: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.prompt_logits is None:
            self.prompt_logits = [[0, 0] for _ in self.token_ids]

    @classmethod
    def from_scheduler_output(cls, output: SchedulerOutput) -> ForwardInput:
        seqs = output.sequences
        prompt_logits = [[0, 0] if s.prompt_logprobs is None else
                         [s.prompt_logprobs.offset, len(s.prompt_logprobs.target_token_ids)] for s in seqs]
        return cls([s.token_ids for s in seqs], [s.num_computed_tokens for s in seqs],
                   [s.block_ids for s in seqs], [s.sampling is not None for s in seqs], prompt_logits)

    def logits_rows(self) -> list[int]:
        """The rows of the step's hidden states whose logits are wanted: each sequence's prompt-scoring
        rows, then its sampling row."""
        rows, start = [], 0
        for ids, needs_logits, (offset, count) in zip(self.token_ids, self.needs_logits, self.prompt_logits):
            rows += range(start + offset, start + offset + count)
            start += len(ids)
            if needs_logits:
                rows.append(start - 1)
        return rows

    @property
    def num_sequences(self) -> int:
        return len(self.token_ids)

    def to_json(self) -> bytes:
        return json.dumps([self.token_ids, self.num_computed_tokens, self.block_tables, self.needs_logits,
                           self.prompt_logits], separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> ForwardInput:
        """Parse and check a step message; raises MalformedStepError on anything unexpected."""
        try:
            fields = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedStepError(f"step message is not JSON: {exc}") from None
        if not isinstance(fields, list) or len(fields) != 5 or not all(isinstance(f, list) for f in fields):
            raise MalformedStepError("step message must be five lists")
        token_ids, num_computed, block_tables, needs_logits, prompt_logits = fields
        if not token_ids or not len(token_ids) == len(num_computed) == len(block_tables) == len(needs_logits) \
                == len(prompt_logits):
            raise MalformedStepError("step message lists must be non-empty and of equal length")
        if not all(_is_int_list(t) and t for t in token_ids) or not _is_int_list(num_computed) \
                or not all(_is_int_list(t) and t for t in block_tables) \
                or not all(isinstance(b, bool) for b in needs_logits) \
                or not all(_is_int_list(p) and len(p) == 2 and p[0] + p[1] <= len(t)
                           for p, t in zip(prompt_logits, token_ids)):
            raise MalformedStepError("step message fields have the wrong types")
        return cls(token_ids, num_computed, block_tables, needs_logits, prompt_logits)


def _is_int_list(values: list) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)
