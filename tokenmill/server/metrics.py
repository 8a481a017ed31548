"""Prometheus metrics of a serving engine, named as vLLM names them with a `tokenmill:` prefix.

Fed once per engine step on the event loop (AsyncLLMEngine's step observer), so no locks of ours.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tokenmill.engine.engine_core import EngineStats
from tokenmill.outputs import RequestOutput

PREFIX = "tokenmill:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class _Progress:
    """What the metrics have already counted of one request."""

    num_output_tokens: list[int]
    last_token_time: list[float | None]
    prompt_counted: bool = False


class ServingMetrics:
    """The /metrics registry of one server."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # the *_created series only add noise to a scrape
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = list(labels)

        def metric(kind, name, doc, extra_labels=(), **kwargs):
            m = kind(PREFIX + name, doc, names + list(extra_labels), registry=self.registry, **kwargs)
            return m if extra_labels else m.labels(**labels)

        self._labels = labels
        self.num_requests_running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = metric(Gauge, "num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = metric(Gauge, "kv_cache_usage_perc", "KV cache blocks in use, 0..1.")
        self.kv_cache_waste_perc = metric(Gauge, "kv_cache_waste_perc", "KV slots allocated but empty, 0..1.")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self.num_preemptions = metric(Counter, "num_preemptions", "Sequences preempted to free KV blocks.")
        self.prefix_cache_queries = metric(Counter, "prefix_cache_queries", "Prompt tokens looked up in the cache.")
        self.prefix_cache_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.request_success = metric(Counter, "request_success", "Finished requests.", ["finished_reason"])
        self.requests_rejected = metric(Counter, "requests_rejected", "Requests refused before start.", ["reason"])
        self.time_to_first_token = metric(
            Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = metric(
            Histogram, "inter_token_latency_seconds", "Time between two tokens of a sequence.",
            buckets=_LATENCY_BUCKETS)
        self.e2e_request_latency = metric(
            Histogram, "e2e_request_latency_seconds", "Arrival to last token.", buckets=_REQUEST_BUCKETS)
        self.request_prompt_tokens = metric(
            Histogram, "request_prompt_tokens", "Prompt length of finished requests.", buckets=_LENGTH_BUCKETS)
        self.request_generation_tokens = metric(
            Histogram, "request_generation_tokens", "Tokens generated per finished request.",
            buckets=_LENGTH_BUCKETS)
        self._progress: dict[str, _Progress] = {}
        self._last_stats: EngineStats | None = None

    def observe_rejection(self, reason: str) -> None:
        self.requests_rejected.labels(reason=reason, **self._labels).inc()

    def observe_step(self, now: float, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._observe_stats(stats)
        for output in outputs:
            self._observe_output(now, output)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _observe_stats(self, stats: EngineStats) -> None:
        kv = stats.kv_cache
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(kv.usage)
        self.kv_cache_waste_perc.set(kv.waste)
        previous = self._last_stats
        if previous is not None:  # engine counters are cumulative; Prometheus wants increments
            self.num_preemptions.inc(stats.num_preemptions - previous.num_preemptions)
            self.prefix_cache_queries.inc(kv.prefix_cache_queries - previous.kv_cache.prefix_cache_queries)
            self.prefix_cache_hits.inc(kv.prefix_cache_hits - previous.kv_cache.prefix_cache_hits)
        self._last_stats = stats

    def _observe_output(self, now: float, output: RequestOutput) -> None:
        progress = self._progress.get(output.request_id)
        if progress is None:
            n = len(output.outputs)
            progress = self._progress[output.request_id] = _Progress([0] * n, [None] * n)
        arrival = output.metrics.arrival_time
        for index, sample in enumerate(output.outputs):
            num_new = len(sample.token_ids) - progress.num_output_tokens[index]
            if num_new <= 0:
                continue
            last = progress.last_token_time[index]
            if last is not None:
                for _ in range(num_new):
                    self.inter_token_latency.observe((now - last) / num_new)
            progress.num_output_tokens[index] += num_new
            progress.last_token_time[index] = now
            self.generation_tokens.inc(num_new)
        if not progress.prompt_counted and output.metrics.first_token_time is not None:
            progress.prompt_counted = True
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.time_to_first_token.observe(output.metrics.first_token_time - arrival)
        if output.finished:
            del self._progress[output.request_id]
            reason = output.outputs[0].finish_reason or "abort"
            self.request_success.labels(finished_reason=reason, **self._labels).inc()
            if progress.prompt_counted:
                self.e2e_request_latency.observe(now - arrival)
                self.request_prompt_tokens.observe(len(output.prompt_token_ids))
                self.request_generation_tokens.observe(sum(progress.num_output_tokens))
