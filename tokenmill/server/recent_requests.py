"""The last requests a server saw, for the console: counts and timings, never text unless --log-prompts."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass

from tokenmill.outputs import RequestOutput

MAX_TEXT_CHARS = 2000  # of prompt and output each, when text is kept at all


@dataclass
class RecentRequest:
    """One request as the console's table shows it."""

    request_id: str
    status: str  # running | finished | aborted | error
    arrival_time: float
    prompt_tokens: int
    output_tokens: int = 0
    num_cached_tokens: int = 0
    ttft: float | None = None  # seconds, arrival to first token
    tokens_per_second: float | None = None  # output tokens after the first / time since the first
    finish_reason: str | None = None
    finished_time: float | None = None
    prompt: str | None = None  # with --log-prompts only
    output: str | None = None  # with --log-prompts only


class RecentRequests:
    """The newest `capacity` requests, updated from the engine's delta outputs."""

    def __init__(self, capacity: int = 50, keep_text: bool = False) -> None:
        self.capacity = capacity
        self.keep_text = keep_text
        self._requests: OrderedDict[str, RecentRequest] = OrderedDict()

    def observe(self, now: float, output: RequestOutput) -> None:
        entry = self._requests.get(output.request_id)
        if entry is None:
            entry = RecentRequest(output.request_id, "running", output.metrics.arrival_time,
                                  len(output.prompt_token_ids))
            if self.keep_text:
                entry.prompt, entry.output = (output.prompt or "")[:MAX_TEXT_CHARS], ""
            self._requests[output.request_id] = entry
            while len(self._requests) > self.capacity:
                self._requests.popitem(last=False)
        entry.output_tokens += sum(len(sample.token_ids) for sample in output.outputs)
        entry.num_cached_tokens = output.num_cached_tokens
        first = output.metrics.first_token_time
        if first is not None:
            entry.ttft = first - entry.arrival_time
            if now > first and entry.output_tokens > 1:
                entry.tokens_per_second = (entry.output_tokens - len(output.outputs)) / (now - first)
        if self.keep_text and entry.output is not None and len(entry.output) < MAX_TEXT_CHARS:
            entry.output = (entry.output + "".join(sample.text for sample in output.outputs))[:MAX_TEXT_CHARS]
        if output.finished:
            entry.finished_time = now
            reasons = [sample.finish_reason for sample in output.outputs if sample.finish_reason]
            entry.finish_reason = reasons[0] if reasons else "abort"
            entry.status = ("error" if output.error is not None else
                            "aborted" if entry.finish_reason == "abort" else "finished")

    def newest_first(self) -> list[dict]:
        return [asdict(entry) for entry in reversed(self._requests.values())]
