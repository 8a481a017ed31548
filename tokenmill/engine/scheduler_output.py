"""The boundary between scheduler and model runner: what to compute in one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.layers.sampler import SamplingSpec


@dataclass
class ScheduledSequence:
    """New tokens of one sequence for this step (a prefill chunk or one decode token)."""

    request_id: str
    token_ids: list[int]  # tokens to compute now
    num_computed_tokens: int  # tokens already in the KV cache before them
    block_ids: list[int]  # the sequence's block table
    sampling: SamplingSpec | None  # set when this step reaches the end of the sequence


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
