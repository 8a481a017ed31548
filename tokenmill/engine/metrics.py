"""What each engine step did, and a sliding window over steps: busy fraction, batch size,
token-budget occupancy, model-FLOPs and memory-bandwidth utilization, cost per token."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.config import ModelConfig
from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.models.model_math import ModelMath

if TYPE_CHECKING:
    from tokenmill.engine.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class StepStats:
    """One engine step, counted from its SchedulerOutput."""

    start_time: float
    duration: float  # seconds spent in step(): schedule, forward, sample, update, detokenize
    num_seqs: int
    num_tokens: int  # tokens computed (prefill chunks + one per decode)
    num_sampled: int  # tokens generated
    attention_pairs: int  # sum over computed tokens of the positions each attends to
    kv_tokens_read: int  # sum over sequences of the cached tokens their attention reads
    num_prefill_tokens: int = 0  # tokens computed that were not the one new token of a decode

    @classmethod
    def from_schedule(cls, output: SchedulerOutput, num_sampled: int, start_time: float,
                      duration: float) -> StepStats:
        pairs = kv_read = num_decode = 0
        for seq in output.sequences:
            n, cached = len(seq.token_ids), seq.num_computed_tokens
            pairs += n * cached + n * (n + 1) // 2
            kv_read += cached
            num_decode += n == 1 and seq.sampling is not None and bool(seq.sampling.output_token_ids)
        return cls(start_time, duration, len(output.sequences), output.num_tokens, num_sampled, pairs, kv_read,
                   output.num_tokens - num_decode)


@dataclass(frozen=True)
class CostModel:
    """Per-step FLOPs and bytes of one model, against a device's peaks."""

    matmul_params: int  # parameters multiplied per token
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float
    attention_flops_per_pair: float  # 4 x layers x heads x head_dim (QK^T and PV)
    peaks: DevicePeaks = field(default_factory=DevicePeaks)  # may be filled in later (device_peaks.py)
    cost_per_hour: float | None = None
    max_num_batched_tokens: int = 2048

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: str, peaks: DevicePeaks, cost_per_hour: float | None = None,
                  max_num_batched_tokens: int = 2048, kv_cache_dtype: str | None = None) -> CostModel:
        model = ModelMath(config)
        return cls(model.num_matmul_params, model.weight_bytes(dtype), model.kv_bytes_per_token(kv_cache_dtype or dtype),
                   model.attention_flops_per_pair, peaks, cost_per_hour, max_num_batched_tokens)

    def flops(self, step: StepStats) -> float:
        return 2 * self.matmul_params * step.num_tokens + self.attention_flops_per_pair * step.attention_pairs

    def bytes(self, step: StepStats) -> float:
        return self.weight_bytes + self.kv_bytes_per_token * (step.kv_tokens_read + step.num_tokens)


@dataclass
class _WindowTotals:
    busy: float = 0.0
    steps: int = 0
    seqs: int = 0
    tokens: int = 0
    output_tokens: int = 0
    prefill_tokens: int = 0
    flops: float = 0.0
    bytes: float = 0.0


class UtilizationWindow:
    """Steps of the last `window_seconds`, with running totals: a summary costs the same however
    many steps the window holds."""

    def __init__(self, cost_model: CostModel, window_seconds: float = 60.0) -> None:
        self.cost_model = cost_model
        self.window_seconds = window_seconds
        self.started = time.time()
        self._steps: deque[StepStats] = deque()
        self._totals_now = _WindowTotals()

    def add(self, step: StepStats) -> None:
        self._steps.append(step)
        self._count(step, 1)
        self._prune(step.start_time + step.duration)  # bounded even when nobody reads the window

    def _count(self, step: StepStats, sign: int) -> None:
        t = self._totals_now
        t.busy += sign * step.duration
        t.steps += sign
        t.seqs += sign * step.num_seqs
        t.tokens += sign * step.num_tokens
        t.output_tokens += sign * step.num_sampled
        t.prefill_tokens += sign * step.num_prefill_tokens
        t.flops += sign * self.cost_model.flops(step)
        t.bytes += sign * self.cost_model.bytes(step)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._steps and self._steps[0].start_time + self._steps[0].duration < horizon:
            self._count(self._steps.popleft(), -1)
        if not self._steps:
            self._totals_now = _WindowTotals()  # no float residue of the subtractions

    def _totals(self, now: float) -> tuple[_WindowTotals, float]:
        self._prune(now)
        return self._totals_now, max(1e-9, min(self.window_seconds, now - self.started))

    def summary(self, now: float | None = None) -> dict[str, float]:
        """Window figures; NaN where undefined (no steps, no peak given, no price given)."""
        now = time.time() if now is None else now
        t, span = self._totals(now)
        model = self.cost_model
        nan = math.nan

        def ratio(a: float, b: float | None) -> float:
            return a / b if b else nan

        output_tps = t.output_tokens / span
        total_tps = t.tokens / span
        dollars = model.cost_per_hour * span / 3600 if model.cost_per_hour is not None else None
        return {
            "window_seconds": span,
            "engine_busy_fraction": min(1.0, t.busy / span),
            "mean_batch_size": ratio(t.seqs, t.steps),
            "token_budget_occupancy": ratio(t.tokens, t.steps * model.max_num_batched_tokens),
            "output_tokens_per_second": output_tps,
            "total_tokens_per_second": total_tps,
            "prefill_tokens_per_second": t.prefill_tokens / span,
            "model_flops_utilization": ratio(t.flops / span, model.peaks.flops),
            "memory_bandwidth_utilization": ratio(t.bytes / span, model.peaks.bandwidth),
            "cost_per_1m_output_tokens": ratio(dollars * 1e6, t.output_tokens) if dollars is not None else nan,
            "cost_per_1m_total_tokens": ratio(dollars * 1e6, t.tokens) if dollars is not None else nan,
        }


class LatencyWindow:
    """Latency samples (seconds) of the last `window_seconds`, for quantiles; at most `max_samples`
    kept (the newest), so a busy server's window stays small."""

    def __init__(self, window_seconds: float = 60.0, max_samples: int = 20_000) -> None:
        self.window_seconds = window_seconds
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time observed, seconds)

    def add(self, now: float, seconds: float, count: int = 1) -> None:
        self._samples.extend(itertools.repeat((now, seconds), count))

    def quantiles(self, qs: tuple[float, ...], now: float | None = None) -> list[float]:
        """Nearest-rank quantiles of the window's samples; NaN when it holds none."""
        now = time.time() if now is None else now
        horizon = now - self.window_seconds
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        values = sorted(v for t, v in self._samples if t <= now)
        if not values:
            return [math.nan] * len(qs)
        return [values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))] for q in qs]
