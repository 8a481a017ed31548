"""The console's stats feed: its numbers are /metrics' at the same instant; ticks, history, SSE."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.engine_info import EngineStats
from tokenmill.engine.kv_cache_manager import KVCacheStats
from tokenmill.engine.metrics import CostModel, LatencyWindow, StepStats, UtilizationWindow
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.server import metrics as server_metrics
from tokenmill.server.metrics import ServingMetrics
from tokenmill.server.recent_requests import RecentRequests
from tokenmill.server.stats_feed import StatsFeed, history_point

T0 = 1_000.0


def _kv(used: int, hits: int, queries: int) -> KVCacheStats:
    return KVCacheStats(num_blocks=100, num_used_blocks=used, num_free_blocks=100 - used, usage=used / 100,
                        num_slots_allocated=16 * used, num_tokens_stored=12 * used, waste=0.25 if used else 0.0,
                        prefix_cache_queries=queries, prefix_cache_hits=hits)


def _output(request_id: str, token_ids: list[int], text: str, first_token_time: float | None,
            finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, "a prompt", [1, 2, 3, 4], [CompletionOutput(0, text, token_ids, finish_reason)],
                         finish_reason is not None, RequestMetrics(T0, T0 + 0.01, first_token_time))


def _fed_metrics(log_prompts: bool = False) -> ServingMetrics:
    """Two requests over five steps: one finishes, one is still running; a preemption, prefix hits."""
    cost = CostModel(matmul_params=1000, weight_bytes=5e3, kv_bytes_per_token=10.0, attention_flops_per_pair=8.0,
                     peaks=DevicePeaks(1e9, 1e8), cost_per_hour=3.6, max_num_batched_tokens=64)
    window = UtilizationWindow(cost, window_seconds=60.0)
    window.started = T0
    metrics = ServingMetrics("m", window, log_prompts=log_prompts)
    steps = [  # (start, outputs, running, waiting, preemptions, kv)
        (T0 + 0.1, [_output("a", [5], "He", T0 + 0.15)], 1, 1, 0, _kv(3, 0, 4)),
        (T0 + 0.2, [_output("a", [6], "llo", T0 + 0.15), _output("b", [7], " x", T0 + 0.25)], 2, 0, 0, _kv(6, 4, 8)),
        (T0 + 0.3, [_output("a", [8, 9], " wor", T0 + 0.15), _output("b", [10], "y", T0 + 0.25)], 2, 0, 1,
         _kv(6, 4, 8)),
        (T0 + 0.4, [_output("a", [11], "ld", T0 + 0.15, "stop")], 1, 0, 1, _kv(3, 4, 8)),
        (T0 + 0.5, [_output("b", [12], "z", T0 + 0.25)], 1, 0, 1, _kv(3, 4, 8)),
    ]
    for i, (start, outputs, running, waiting, preemptions, kv) in enumerate(steps):
        step = StepStats(start, 0.05, running, 4 if i < 2 else running, len(outputs), 10 * (i + 1), 4 * i,
                         num_prefill_tokens=4 if i < 2 else 0)
        stats = EngineStats(running, waiting, preemptions, kv, num_steps=i + 1, last_step=step)
        metrics.observe_step(start + 0.05, outputs, stats)
    return metrics


def _scrape(text: bytes) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            key = sample.name.removeprefix("tokenmill:")
            if sample.name.endswith(("_bucket", "_count", "_sum")):
                continue
            values[key] = values.get(key, 0.0) + sample.value  # labelled series summed
    return values


def test_feed_numbers_equal_metrics_at_the_same_instant():
    metrics = _fed_metrics()
    now = T0 + 10.0
    scraped = _scrape(metrics.render(now))
    snapshot = StatsFeed(metrics, {"model_name": "m"}).snapshot(now)
    window = snapshot["window"]
    compared = 0
    for key, value in window.items():
        if key == "window_seconds":
            continue
        gauge = scraped[key]
        if value is None:
            assert math.isnan(gauge), key
        else:
            assert gauge == pytest.approx(value, rel=1e-12, abs=1e-15), key
        compared += 1
    assert compared == 14  # every window figure is a gauge
    engine, totals = snapshot["engine"], snapshot["totals"]
    assert engine["num_requests_running"] == scraped["num_requests_running"] == 1
    assert engine["num_requests_waiting"] == scraped["num_requests_waiting"] == 0
    assert engine["kv_cache"]["usage"] == scraped["kv_cache_usage_perc"] == 0.03
    assert engine["kv_cache"]["waste"] == scraped["kv_cache_waste_perc"]
    assert engine["num_preemptions"] == scraped["num_preemptions_total"] == 1
    assert engine["kv_cache"]["prefix_cache_hits"] == scraped["prefix_cache_hits_total"] == 4
    assert engine["kv_cache"]["prefix_cache_queries"] == scraped["prefix_cache_queries_total"] == 8
    assert engine["prefix_cache_hit_rate"] == 0.5
    assert totals["generation_tokens"] == scraped["generation_tokens_total"] == 8
    assert totals["prompt_tokens"] == scraped["prompt_tokens_total"] == 8
    assert totals["requests_finished"] == scraped["request_success_total"] == 1
    # and the figures themselves, from the steps fed
    assert window["output_tokens_per_second"] == pytest.approx(7 / 10)  # num_sampled of the steps
    assert window["prefill_tokens_per_second"] == pytest.approx(8 / 10)
    assert window["time_to_first_token_p50_seconds"] == pytest.approx(0.15)  # (0.15, 0.25): nearest rank
    assert window["time_to_first_token_p99_seconds"] == pytest.approx(0.25)


def test_snapshot_counts_ttft_and_itl_samples_like_the_histograms():
    metrics = _fed_metrics()
    scraped = {}
    for family in text_string_to_metric_families(metrics.render(T0 + 5).decode()):
        for sample in family.samples:
            scraped[sample.name] = sample.value
    ttft = metrics.ttft_window.quantiles((0.5,), T0 + 5)
    assert scraped["tokenmill:time_to_first_token_seconds_count"] == 2 and not math.isnan(ttft[0])
    assert len(metrics.itl_window._samples) == scraped["tokenmill:inter_token_latency_seconds_count"] == 6


def test_per_token_counts_reach_the_histograms_once_and_stay_bounded_unscraped(monkeypatch):
    """A step only counts; /metrics exports what was counted since the last read, once, and a
    server nobody scrapes exports every MAX_UNEXPORTED steps' latencies instead of keeping them."""
    monkeypatch.setattr(server_metrics, "MAX_UNEXPORTED", 10)
    metrics = ServingMetrics("m")
    stats = EngineStats(1, 0, 0, _kv(1, 0, 0), num_steps=0)
    metrics.observe_step(T0, [_output("a", [1], "x", T0)], stats)
    for i in range(1, 26):  # 25 more steps, two tokens each
        metrics.observe_step(T0 + 0.1 * i, [_output("a", [2 * i, 2 * i + 1], "yz", T0)], stats)
        assert len(metrics._unexported_itls) <= 10
    def scrape() -> dict[str, float]:
        return {sample.name.removeprefix("tokenmill:") + sample.labels.get("le", ""): sample.value
                for family in text_string_to_metric_families(metrics.render(T0 + 3).decode())
                for sample in family.samples if "inter_token" in sample.name or "generation" in sample.name}

    scraped = scrape()
    assert scraped["inter_token_latency_seconds_count"] == 50
    assert scraped["inter_token_latency_seconds_sum"] == pytest.approx(50 * 0.05)  # two tokens per 0.1 s
    assert scraped["inter_token_latency_seconds_bucket0.04"] == 0
    assert scraped["inter_token_latency_seconds_bucket0.06"] == 50
    assert scraped["generation_tokens_total"] == 51
    assert scrape() == scraped  # a second read counts nothing twice


def test_latency_window_quantiles_and_expiry():
    window = LatencyWindow(window_seconds=10.0)
    assert all(math.isnan(q) for q in window.quantiles((0.5, 0.99), now=0.0))
    for i in range(1, 101):
        window.add(91 + 0.09 * i, i / 100)
    assert window.quantiles((0.5, 0.99), now=100.0) == [0.5, 0.99]
    assert window.quantiles((0.0, 1.0), now=105.0) == [0.45, 1.0]  # only the last 10 s are left
    window.add(105.0, 2.0, count=3)  # one observation standing for several tokens
    assert window.quantiles((0.95, 1.0), now=105.0) == [2.0, 2.0]
    assert all(math.isnan(q) for q in window.quantiles((0.5,), now=1000.0))


def test_recent_requests_keep_counts_and_no_text_by_default():
    metrics = _fed_metrics()
    newest = metrics.snapshot(T0 + 1)["recent_requests"]
    assert [r["request_id"] for r in newest] == ["b", "a"]
    b, a = newest
    assert (a["status"], a["finish_reason"], a["output_tokens"], a["prompt_tokens"]) == ("finished", "stop", 5, 4)
    assert a["ttft"] == pytest.approx(0.15)
    assert a["tokens_per_second"] == pytest.approx(4 / (T0 + 0.45 - (T0 + 0.15)))
    assert (b["status"], b["finish_reason"], b["output_tokens"]) == ("running", None, 3)
    assert a["prompt"] is None and a["output"] is None
    assert "a prompt" not in json.dumps(newest) and "llo" not in json.dumps(newest)
    with_text = _fed_metrics(log_prompts=True).snapshot(T0 + 1)["recent_requests"]
    assert with_text[1]["prompt"] == "a prompt" and with_text[1]["output"] == "Hello world"


def test_recent_requests_statuses_and_capacity():
    recent = RecentRequests(capacity=3)
    for i in range(5):
        recent.observe(T0, _output(f"r{i}", [1], "x", T0 + 0.1))
    recent.observe(T0 + 1, _output("r4", [], "", T0 + 0.1, "abort"))
    failed = _output("r3", [], "", T0 + 0.1, "error")
    failed.error = RuntimeError("boom")
    recent.observe(T0 + 1, failed)
    rows = recent.newest_first()
    assert [(r["request_id"], r["status"]) for r in rows] == [("r4", "aborted"), ("r3", "error"), ("r2", "running")]


def test_history_points_and_ticks_wake_subscribers():
    async def run() -> list[dict]:
        metrics = _fed_metrics()
        feed = StatsFeed(metrics, {"model_name": "m"}, interval=0.05, history_seconds=0.2)
        task = asyncio.create_task(feed.run())
        events = feed.events()
        first = json.loads((await anext(events)).removeprefix("data: "))
        second = json.loads((await anext(events)).removeprefix("data: "))
        third = json.loads((await anext(events)).removeprefix("data: "))
        await asyncio.sleep(0.4)
        task.cancel()
        return [first, second, third, list(feed.history)]

    first, second, third, history = asyncio.run(run())
    assert "history" in first and first["facts"] == {"model_name": "m"}
    assert "history" not in second and first["time"] <= second["time"] < third["time"]
    assert len(history) == 4  # 0.2 s of history at 0.05 s per point
    assert history[-1] == history_point(third) or history[-1]["time"] > third["time"]
    point = history_point(second)
    assert point["num_requests_running"] == 1 and point["kv_cache_usage"] == 0.03


def test_history_point_of_an_engine_without_steps():
    point = history_point({"time": 1.0, "engine": {}, "window": {}})
    assert point["num_requests_running"] == 0 and point["kv_cache_usage"] == 0.0
