"""What a step samples (SampledToken) and what generate() returns (vLLM's RequestOutput /
CompletionOutput shapes)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SampledToken:
    """One token sampled for one sequence in a step, with its logprobs when they were asked for."""

    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first


# One entry per generated token: token id -> Logprob (the chosen one plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, the same way; the first token has none.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class ModelRunnerOutput:
    """What one step computed: a token for each sequence that samples, in order, and the prompt
    tokens it scored, with their logprobs (request id -> tokens, in prompt order)."""

    sampled: list[SampledToken]
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputKind(enum.Enum):
    """What each output of a request holds (vLLM's RequestOutputKind)."""

    CUMULATIVE = "cumulative"  # everything so far, at every step
    DELTA = "delta"  # only what is new since the previous output: text, token ids, logprobs
    FINAL_ONLY = "final_only"  # one output, at the end, with everything


@dataclass
class RequestOutput:
    """The result (or, while streaming, the progress) of one request.

    With OutputKind.DELTA each CompletionOutput holds only what the step added; merge_deltas
    folds a run of them back into one.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: BaseException | None = None  # the request failed (finish reason "error")
    prompt_logprobs: PromptLogprobs | None = None  # with DELTA outputs: in the first one only


def merge_deltas(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta output for two consecutive ones of the same request (`first` is updated)."""
    by_index = {c.index: c for c in first.outputs}
    for new in later.outputs:
        old = by_index.get(new.index)
        if old is None:
            first.outputs.append(new)
            by_index[new.index] = new
            continue
        old.text += new.text
        old.token_ids = old.token_ids + new.token_ids
        if new.logprobs is not None:
            old.logprobs = (old.logprobs or []) + new.logprobs
        old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
    first.outputs.sort(key=lambda c: c.index)
    first.finished, first.metrics, first.error = later.finished, later.metrics, later.error
    first.num_cached_tokens = later.num_cached_tokens
    first.prompt_logprobs = first.prompt_logprobs or later.prompt_logprobs
    return first
