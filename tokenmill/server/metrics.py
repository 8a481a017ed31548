"""Prometheus metrics of a serving engine, named as vLLM names them with a `tokenmill:` prefix,
plus what vLLM does not show: busy fraction, batch size, budget occupancy, MFU/MBU and cost.

Fed once per engine step on the event loop (AsyncLLMEngine's step observer), so no locks of ours.
A step only updates plain Python counts: the engine's gauges and counters, the inter-token latency
histogram and the generated-token counter are brought up to date when /metrics is read (a step's
~10 Prometheus updates, each taking a lock, cost the API process ~60 us of CPU a token, on the
cores the engine decodes on); the windowed figures are computed when /metrics or /v1/stats is read
(or the console's feed ticks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tokenmill.engine.engine_info import EngineStats
from tokenmill.engine.metrics import LatencyWindow, UtilizationWindow
from tokenmill.outputs import RequestOutput
from tokenmill.server.recent_requests import RecentRequests

PREFIX = "tokenmill:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_WINDOW_GAUGES = {
    "engine_busy_fraction": "Share of wall time the engine loop spent in steps",
    "mean_batch_size": "Mean sequences per engine step",
    "token_budget_occupancy": "Mean tokens per step / max_num_batched_tokens",
    "model_flops_utilization": "Estimated model FLOP/s / device peak",
    "memory_bandwidth_utilization": "Estimated bytes/s (weights + KV) / device peak",
    "output_tokens_per_second": "Generated tokens per second",
    "prefill_tokens_per_second": "Prompt (and recomputed) tokens computed per second",
    "total_tokens_per_second": "Tokens computed per second, prompt and generated",
    "cost_per_1m_output_tokens": "Dollars per 1M generated tokens at --cost-per-hour",
    "cost_per_1m_total_tokens": "Dollars per 1M computed tokens (prompt + generated) at --cost-per-hour",
}
# window quantiles of the two latencies users feel: (summary key, doc)
_LATENCY_GAUGES = {
    "time_to_first_token_p50_seconds": "Median time to first token",
    "time_to_first_token_p99_seconds": "99th percentile time to first token",
    "inter_token_latency_p50_seconds": "Median time between two tokens of a sequence",
    "inter_token_latency_p99_seconds": "99th percentile time between two tokens of a sequence",
}
# per data-parallel replica, labelled replica="0".. (the unlabelled families are the sums)
_REPLICA_GAUGES = {
    "up": "1 while the replica's engine process serves, 0 once it is down.",
    "num_requests_running": "Requests in the replica's running batch.",
    "num_requests_waiting": "Requests waiting in the replica's queue.",
    "kv_cache_usage_perc": "The replica's KV cache blocks in use, 0..1.",
    "prefix_cache_queries": "Prompt tokens the replica looked up in its cache (since it started).",
    "prefix_cache_hits": "Prompt tokens the replica found in its cache (since it started).",
}
MAX_UNEXPORTED = 4096  # steps' latencies kept for the next /metrics read before they are exported anyway
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass
class _Progress:
    """What the metrics have already counted of one request."""

    num_output_tokens: list[int]
    last_token_time: list[float | None]
    prompt_counted: bool = False


class ServingMetrics:
    """The /metrics registry of one server."""

    def __init__(self, model_name: str, window: UtilizationWindow | None = None, log_prompts: bool = False) -> None:
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
        self.time_per_output_token = metric(
            Histogram, "time_per_output_token_seconds", "Decode time / (output tokens - 1), per request.",
            buckets=_LATENCY_BUCKETS)
        self.request_queue_time = metric(
            Histogram, "request_queue_time_seconds", "Arrival to first scheduled.", buckets=_REQUEST_BUCKETS)
        self.request_prefill_time = metric(
            Histogram, "request_prefill_time_seconds", "First scheduled to first token.", buckets=_REQUEST_BUCKETS)
        self.request_decode_time = metric(
            Histogram, "request_decode_time_seconds", "First token to last token.", buckets=_REQUEST_BUCKETS)
        self.replica_gauges = {
            key: metric(Gauge, f"replica_{key}", doc, ["replica"]) for key, doc in _REPLICA_GAUGES.items()}
        self.replica_source: Callable[[], list] | None = None  # ReplicaSet.statuses with --data-parallel-size
        self.window = window
        window_seconds = window.window_seconds if window is not None else 60.0
        self.ttft_window = LatencyWindow(window_seconds)
        self.itl_window = LatencyWindow(window_seconds)
        gauges = {**(_WINDOW_GAUGES if window is not None else {}), **_LATENCY_GAUGES}
        for key, doc in gauges.items():
            gauge = metric(Gauge, key, f"{doc} (last {window_seconds:g} s).")
            gauge.set_function(lambda key=key: self._window_value(key))
        self.recent = RecentRequests(keep_text=log_prompts)
        self._window_values: dict[str, float] = {}
        self._progress: dict[str, _Progress] = {}
        self._engine_counters = (self.num_preemptions, self.prefix_cache_queries, self.prefix_cache_hits)
        self._engine_counts = (0, 0, 0)  # what they have counted of the engine's cumulative figures
        self.engine_stats: EngineStats | None = None
        self._unexported_itls: list[tuple[float, int]] = []  # (seconds, tokens) not yet in the histogram
        self._unexported_generation_tokens = 0
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0, "requests_rejected": 0}

    def observe_rejection(self, reason: str) -> None:
        self.requests_rejected.labels(reason=reason, **self._labels).inc()
        self.totals["requests_rejected"] += 1

    def observe_step(self, now: float, outputs: list[RequestOutput], stats: EngineStats) -> None:
        previous = self.engine_stats
        if self.window is not None and stats.last_step is not None and (
                previous is None or stats.num_steps > previous.num_steps):
            self.window.add(stats.last_step)
        self.observe_engine(stats)
        for output in outputs:
            self._observe_output(now, output)
            self.recent.observe(now, output)

    def render(self, now: float | None = None) -> bytes:
        self._export_engine_stats()
        self._export_token_counts()
        self._window_values = self.window_summary(now)  # one summary per scrape, read by every window gauge
        self._replica_rows()
        return generate_latest(self.registry)

    def _replica_rows(self) -> list[dict]:
        """Each replica's figures (set on the replica gauges too); [] without replicas."""
        if self.replica_source is None:
            return []
        rows = []
        for status in self.replica_source():
            row = replica_row(status)
            for key, gauge in self.replica_gauges.items():
                gauge.labels(replica=str(status.index), **self._labels).set(float(row[key]))
            rows.append(row)
        return rows

    def window_summary(self, now: float | None = None) -> dict[str, float]:
        """The window's figures at `now` (default: the present), latency quantiles included."""
        now = time.time() if now is None else now
        summary = self.window.summary(now) if self.window is not None else {}
        for name, latencies in (("time_to_first_token", self.ttft_window), ("inter_token_latency", self.itl_window)):
            p50, p99 = latencies.quantiles((0.5, 0.99), now)
            summary[f"{name}_p50_seconds"], summary[f"{name}_p99_seconds"] = p50, p99
        return summary

    def snapshot(self, now: float | None = None) -> dict:
        """The same numbers as /metrics at `now`, as JSON for people and dashboards (NaN becomes
        null), with the recent requests."""
        now = time.time() if now is None else now
        stats = self.engine_stats
        engine = {}
        if stats is not None:
            kv = stats.kv_cache
            engine = {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
                      "num_preemptions": stats.num_preemptions, "num_steps": stats.num_steps,
                      "kv_cache": asdict(kv),
                      "prefix_cache_hit_rate": kv.prefix_cache_hits / kv.prefix_cache_queries
                      if kv.prefix_cache_queries else None}
        window = {k: (None if isinstance(v, float) and math.isnan(v) else v)
                  for k, v in self.window_summary(now).items()}
        peaks = self.window.cost_model.peaks if self.window is not None else None  # measured after start-up
        replicas = self._replica_rows()
        if replicas:
            engine["replicas"] = replicas
        return {"time": now, "model": self._labels["model_name"], "engine": engine, "totals": dict(self.totals),
                "window": window, "recent_requests": self.recent.newest_first(),
                "peaks": {"tflops": peaks.flops / 1e12 if peaks and peaks.flops else None,
                          "bandwidth_gbs": peaks.bandwidth / 1e9 if peaks and peaks.bandwidth else None}}

    def _window_value(self, key: str) -> float:
        return self._window_values.get(key, math.nan)

    def observe_engine(self, stats: EngineStats) -> None:
        """The engine's latest figures (each step; once at start, so that they exist before one)."""
        self.engine_stats = stats

    def _export_engine_stats(self) -> None:
        """The engine's gauges and counters as of its latest figures."""
        stats = self.engine_stats
        if stats is None:
            return
        kv = stats.kv_cache
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(kv.usage)
        self.kv_cache_waste_perc.set(kv.waste)
        # engine counters are cumulative (from 0, as ours are); Prometheus wants increments
        counts = (stats.num_preemptions, kv.prefix_cache_queries, kv.prefix_cache_hits)
        for counter, count, counted in zip(self._engine_counters, counts, self._engine_counts):
            counter.inc(count - counted)
        self._engine_counts = counts

    def _export_token_counts(self) -> None:
        """The inter-token latencies and generated tokens counted since the last export."""
        for seconds, count in self._unexported_itls:
            for _ in range(count):
                self.inter_token_latency.observe(seconds)
        self._unexported_itls.clear()
        self.generation_tokens.inc(self._unexported_generation_tokens)
        self._unexported_generation_tokens = 0

    def _observe_output(self, now: float, output: RequestOutput) -> None:
        if len(self._unexported_itls) >= MAX_UNEXPORTED:  # bounded where nobody reads /metrics
            self._export_token_counts()
        progress = self._progress.get(output.request_id)
        if progress is None:
            n = len(output.outputs)
            progress = self._progress[output.request_id] = _Progress([0] * n, [None] * n)
        arrival = output.metrics.arrival_time
        for index, sample in enumerate(output.outputs):  # delta outputs: each holds only the new tokens
            num_new = len(sample.token_ids)
            if num_new <= 0:
                continue
            last = progress.last_token_time[index]
            if last is not None:
                self._unexported_itls.append(((now - last) / num_new, num_new))
                self.itl_window.add(now, (now - last) / num_new, num_new)
            progress.num_output_tokens[index] += num_new
            progress.last_token_time[index] = now
            self._unexported_generation_tokens += num_new
            self.totals["generation_tokens"] += num_new
        if not progress.prompt_counted and output.metrics.first_token_time is not None:
            progress.prompt_counted = True
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.totals["prompt_tokens"] += len(output.prompt_token_ids)
            self.time_to_first_token.observe(output.metrics.first_token_time - arrival)
            self.ttft_window.add(now, output.metrics.first_token_time - arrival)
        if output.finished:
            del self._progress[output.request_id]
            reason = output.outputs[0].finish_reason or "abort"
            self.request_success.labels(finished_reason=reason, **self._labels).inc()
            self.totals["requests_finished"] += 1
            if progress.prompt_counted:
                self._observe_finished(now, output, sum(progress.num_output_tokens))

    def _observe_finished(self, now: float, output: RequestOutput, num_output_tokens: int) -> None:
        times = output.metrics
        self.e2e_request_latency.observe(now - times.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_output_tokens)
        if times.first_scheduled_time is not None:
            self.request_queue_time.observe(times.first_scheduled_time - times.arrival_time)
            self.request_prefill_time.observe(times.first_token_time - times.first_scheduled_time)
        decode_time = now - times.first_token_time
        self.request_decode_time.observe(decode_time)
        tokens_per_sequence = num_output_tokens / max(1, len(output.outputs))
        if tokens_per_sequence > 1:
            self.time_per_output_token.observe(decode_time / (tokens_per_sequence - 1))


def replica_row(status) -> dict:
    """One data-parallel replica (a ReplicaStatus) as /v1/stats and /v1/replicas show it; a
    replica that is down shows nothing in use, and its last counts."""
    stats, kv = status.stats, status.stats.kv_cache
    return {"replica": status.index, "up": status.up, "pid": status.pid, "cpu_cores": status.cpu_cores,
            "node": status.node,
            "requests_in_flight": status.requests_in_flight,
            "num_requests_running": stats.num_running if status.up else 0,
            "num_requests_waiting": stats.num_waiting if status.up else 0,
            "kv_cache_usage_perc": kv.usage if status.up else 0.0,
            "kv_cache": asdict(kv),
            "prefix_cache_queries": kv.prefix_cache_queries, "prefix_cache_hits": kv.prefix_cache_hits}
