"""The boundary between scheduler and model runner: what to compute and sample in one step."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass
class TokenBitmaskRow:
    """A sequence's row of its step's structured-output bitmask, which a worker thread computes
    while the forward pass runs: int32 [ceil(vocab / 32)], bit j of word w set when token
    32 * w + j may come next."""

    batch: Future  # of int32 [num_constrained, ceil(vocab / 32)]
    row: int

    def get(self) -> torch.Tensor:
        return self.batch.result()[self.row]


@dataclass
class SamplingRequest:
    """What to sample for a sequence that reaches its last known token this step."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far
    stop_token_ids: frozenset[int]  # tokens that end the sequence (stop_token_ids, and EOS unless ignored)
    allowed_tokens: TokenBitmaskRow | None = None  # structured outputs: what may come next


@dataclass
class PromptLogprobsRequest:
    """Prompt logprobs to score this step: the logits of new tokens [offset, offset + len(target_token_ids))
    of the sequence, each for the prompt token that follows it."""

    offset: int
    target_token_ids: list[int]
    num_top: int


@dataclass
class ScheduledSequence:
    """New tokens of one sequence for this step (a prefill chunk or one decode token)."""

    request_id: str
    token_ids: list[int]  # tokens to compute now
    num_computed_tokens: int  # tokens already in the KV cache before them
    block_ids: list[int]  # the sequence's block table
    sampling: SamplingRequest | None  # set when this step reaches the end of the sequence
    prompt_logprobs: PromptLogprobsRequest | None = None


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
