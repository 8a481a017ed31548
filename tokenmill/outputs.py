"""What a step samples (SampledToken) and what generate() returns (vLLM's RequestOutput /
CompletionOutput shapes)."""

from __future__ import annotations

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


@dataclass
class RequestOutput:
    """The result (or, while streaming, the progress) of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # Text appended since the previous output of this request, per sample index.
    deltas: dict[int, str] = field(default_factory=dict)
