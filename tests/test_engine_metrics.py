"""Step accounting and the utilization window: FLOPs, bytes, busy fraction, cost per token."""

from __future__ import annotations

import math

import pytest

from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.metrics import CostModel, StepStats, UtilizationWindow
from tokenmill.engine.scheduler_output import ScheduledSequence, SchedulerOutput


def _seq(num_new: int, num_cached: int) -> ScheduledSequence:
    return ScheduledSequence("r", list(range(num_new)), num_cached, [0], None)


def test_step_stats_count_tokens_pairs_and_kv_reads():
    schedule = SchedulerOutput([_seq(4, 0), _seq(1, 10), _seq(1, 20)])
    step = StepStats.from_schedule(schedule, num_sampled=3, start_time=100.0, duration=0.5)
    assert (step.num_seqs, step.num_tokens, step.num_sampled) == (3, 6, 3)
    assert step.attention_pairs == (1 + 2 + 3 + 4) + 11 + 21  # causal prefill, then each decode's context
    assert step.kv_tokens_read == 30


def test_window_summary():
    model = CostModel(matmul_params=1000, weight_bytes=5000.0, kv_bytes_per_token=10.0,
                      attention_flops_per_pair=8.0, peaks=DevicePeaks(1e6, 1e5), cost_per_hour=36.0,
                      max_num_batched_tokens=8)
    window = UtilizationWindow(model, window_seconds=10.0)
    window.started = 0.0
    steps = [StepStats(1.0, 0.5, 2, 4, 2, 10, 6), StepStats(2.0, 1.5, 2, 2, 2, 30, 40)]
    for step in steps:
        window.add(step)
    summary = window.summary(now=10.0)
    assert summary["window_seconds"] == 10.0
    assert summary["engine_busy_fraction"] == pytest.approx(0.2)
    assert summary["mean_batch_size"] == 2
    assert summary["token_budget_occupancy"] == pytest.approx(6 / 16)
    flops = 2 * 1000 * 6 + 8 * 40
    assert summary["model_flops_utilization"] == pytest.approx(flops / 10 / 1e6)
    bytes_moved = 2 * 5000 + 10 * (6 + 4 + 40 + 2)
    assert summary["memory_bandwidth_utilization"] == pytest.approx(bytes_moved / 10 / 1e5)
    assert summary["output_tokens_per_second"] == pytest.approx(0.4)
    assert summary["cost_per_1m_output_tokens"] == pytest.approx(36.0 * 10 / 3600 / 4 * 1e6)
    # steps leave the window once they are older than it
    assert window.summary(now=13.0)["mean_batch_size"] == 2
    assert math.isnan(window.summary(now=100.0)["mean_batch_size"])


def test_unknown_peaks_and_price_are_nan():
    window = UtilizationWindow(CostModel(1, 1.0, 1.0, 1.0))
    window.add(StepStats(window.started, 0.1, 1, 1, 1, 1, 0))
    summary = window.summary()
    for key in ("model_flops_utilization", "memory_bandwidth_utilization", "cost_per_1m_output_tokens"):
        assert math.isnan(summary[key])
