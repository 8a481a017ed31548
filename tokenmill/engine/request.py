"""Request: one sequence being generated, and its lifecycle status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.outputs import Logprob, PromptLogprobs, RequestMetrics
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.structured_output import GrammarMatcher


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the engine failed on this request (only it)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass(repr=False, eq=False)
class Request:
    """One sequence. A request with n > 1 is n of these sharing a parent_id.

    num_computed_tokens catches up with num_tokens: that one counter covers prefill,
    chunked prefill, prefix-cache hits and recomputation after preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    seed: int
    eos_token_ids: frozenset[int]
    parent_id: str = ""
    index: int = 0
    prompt: str | None = None
    prefill_leader: Request | None = None  # sibling whose prompt blocks this one waits to share
    arrival_time: float = field(default_factory=time.time)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # [None] + one entry per prompt token scored so far
    block_hashes: list[bytes] = field(default_factory=list)  # content hash of each full block
    grammar: GrammarMatcher | None = None  # structured outputs: advanced by every kept output token

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id
        self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        # The tokens that end this sequence once params.may_stop_at allows it.
        self.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.index == 0:  # one sample scores the prompt
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens still to score: its prompt must be computed, not read from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request(id={self.request_id!r}, prompt_len={self.num_prompt_tokens}, "
            f"output_len={self.num_output_tokens}, computed={self.num_computed_tokens}, status={self.status.name})"
        )
