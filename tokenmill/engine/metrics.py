"""What each engine step did, and a sliding window over steps: busy fraction, batch size,
token-budget occupancy, model-FLOPs and memory-bandwidth utilization, cost per token."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.config import ModelConfig
from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.models.model_math import ModelMath


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

    @classmethod
    def from_schedule(cls, output: SchedulerOutput, num_sampled: int, start_time: float,
                      duration: float) -> StepStats:
        pairs = kv_read = 0
        for seq in output.sequences:
            n, cached = len(seq.token_ids), seq.num_computed_tokens
            pairs += n * cached + n * (n + 1) // 2
            kv_read += cached
        return cls(start_time, duration, len(output.sequences), output.num_tokens, num_sampled, pairs, kv_read)


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
                  max_num_batched_tokens: int = 2048) -> CostModel:
        model = ModelMath(config)
        return cls(model.num_matmul_params, model.weight_bytes(dtype), model.kv_bytes_per_token(dtype),
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
    flops: float = 0.0
    bytes: float = 0.0


class UtilizationWindow:
    """Steps of the last `window_seconds`, summarised on demand."""

    def __init__(self, cost_model: CostModel, window_seconds: float = 60.0) -> None:
        self.cost_model = cost_model
        self.window_seconds = window_seconds
        self.started = time.time()
        self._steps: deque[StepStats] = deque()

    def add(self, step: StepStats) -> None:
        self._steps.append(step)
        self._prune(step.start_time + step.duration)  # bounded even when nobody reads the window

    def _prune(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._steps and self._steps[0].start_time + self._steps[0].duration < horizon:
            self._steps.popleft()

    def _totals(self, now: float) -> tuple[_WindowTotals, float]:
        self._prune(now)
        totals = _WindowTotals()
        for step in self._steps:
            totals.busy += step.duration
            totals.steps += 1
            totals.seqs += step.num_seqs
            totals.tokens += step.num_tokens
            totals.output_tokens += step.num_sampled
            totals.flops += self.cost_model.flops(step)
            totals.bytes += self.cost_model.bytes(step)
        return totals, max(1e-9, min(self.window_seconds, now - self.started))

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
            "model_flops_utilization": ratio(t.flops / span, model.peaks.flops),
            "memory_bandwidth_utilization": ratio(t.bytes / span, model.peaks.bandwidth),
            "cost_per_1m_output_tokens": ratio(dollars * 1e6, t.output_tokens) if dollars is not None else nan,
            "cost_per_1m_total_tokens": ratio(dollars * 1e6, t.tokens) if dollars is not None else nan,
        }
