"""Capacity and cost of serving a model on an accelerator: rooflines, KV capacity, break-even.

Bounds are rooflines: a decode step must read every weight and the batch's KV cache once (memory
bound) and do 2 x params FLOPs per token (compute bound), whichever is slower. `efficiency` scales
the bounds to what a real engine reaches (tokenmill measures ~0.5 of the roofline on CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tokenmill.config import DEFAULT_BLOCK_SIZE, DEFAULT_KV_CACHE_FRACTION
from tokenmill.errors import InvalidParameterError
from tokenmill.hardware import Accelerator
from tokenmill.models.model_math import ModelMath

HOURS_PER_MONTH = 730.0
CPU_KV_FRACTION = DEFAULT_KV_CACHE_FRACTION["cpu"]  # of the available memory
GPU_KV_FRACTION = DEFAULT_KV_CACHE_FRACTION["cuda"]  # of the memory left after the weights
# Share of the roofline engines reach: tokenmill on CPU measured 0.55 (W2) and 0.30 (batch-1 decode);
# GPU engines commonly reach 0.6-0.7 of the memory roof when decoding.
CPU_EFFICIENCY = 0.5
GPU_EFFICIENCY = 0.6


@dataclass
class PlanInputs:
    accelerator: Accelerator
    dtype: str = "bfloat16"
    weight_quant: str | None = None
    context: int = 4096
    concurrency: int | None = None  # None: as many as fit
    cost_per_hour: float | None = None  # per device; None: the accelerator's typical price
    api_price_per_1m: float | None = None
    tensor_parallel: int = 1
    utilization: float = 0.5
    efficiency: float = 1.0
    kv_memory_bytes: float | None = None  # per device; None: the engine's default share
    kv_cache_dtype: str | None = None  # what the KV pool holds; None: dtype

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype


@dataclass
class Plan:
    """The answer; `tokenmill plan --json` prints it as one object."""

    model_params: int
    weights_bytes: float  # per device
    kv_bytes_per_token: float  # per device
    kv_memory_bytes: float  # per device
    max_kv_tokens: int
    max_concurrent_sequences: int
    concurrency: int
    decode_tokens_per_s_bound: float  # one sequence alone
    aggregate_decode_tokens_per_s_bound: float  # `concurrency` sequences
    decode_bound_by: str  # "memory" | "compute"
    prefill_tokens_per_s_bound: float
    cost_per_hour: float  # all devices
    cost_per_1m_tokens: float  # output tokens, at full utilization
    cost_per_1m_tokens_at_utilization: float
    utilization: float
    efficiency: float
    monthly_capacity_tokens: float
    break_even_tokens_per_month: float | None

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(model: ModelMath, inputs: PlanInputs) -> Plan:
    acc, tp = inputs.accelerator, inputs.tensor_parallel
    if tp < 1 or model.config.num_key_value_heads % tp:
        raise InvalidParameterError(
            f"tensor_parallel must divide the {model.config.num_key_value_heads} KV heads", param="tensor_parallel")
    if not 0 < inputs.utilization <= 1 or not 0 < inputs.efficiency <= 1:
        raise InvalidParameterError("utilization and efficiency must be in (0, 1]", param="utilization")
    weights = model.weight_bytes(inputs.dtype, inputs.weight_quant) / tp
    kv_per_token = model.kv_bytes_per_token(inputs.kv_dtype) / tp
    memory = acc.memory_gb * 1e9
    if weights >= memory:
        raise InvalidParameterError(
            f"the weights need {weights / 1e9:.1f} GB per device but {acc.name} has {acc.memory_gb:g} GB; "
            f"try --weight-quant or --tensor-parallel", param="tensor_parallel")
    kv_memory = inputs.kv_memory_bytes
    if kv_memory is None:
        kv_memory = memory * CPU_KV_FRACTION if acc.name == "cpu" else (memory - weights) * GPU_KV_FRACTION
    block_bytes = kv_per_token * DEFAULT_BLOCK_SIZE
    max_kv_tokens = int(kv_memory // block_bytes) * DEFAULT_BLOCK_SIZE
    blocks_per_seq = -(-inputs.context // DEFAULT_BLOCK_SIZE)
    max_sequences = max_kv_tokens // (blocks_per_seq * DEFAULT_BLOCK_SIZE)
    concurrency = max(1, min(inputs.concurrency or max_sequences, max(max_sequences, 1)))

    bandwidth = acc.bandwidth_gbs * 1e9 * tp
    flops = acc.bf16_tflops * 1e12 * tp
    step_one, _ = decode_step_seconds(model, inputs, 1, bandwidth, flops)
    step_many, bound_by = decode_step_seconds(model, inputs, concurrency, bandwidth, flops)
    aggregate = concurrency / step_many * inputs.efficiency
    prefill = flops / model.flops_per_token(inputs.context // 2) * inputs.efficiency

    price = (inputs.cost_per_hour if inputs.cost_per_hour is not None else acc.price_per_hour) * tp
    cost_per_1m = price / (aggregate * 3600) * 1e6
    capacity = aggregate * 3600 * HOURS_PER_MONTH
    break_even = None
    if inputs.api_price_per_1m:
        break_even = price * HOURS_PER_MONTH / inputs.api_price_per_1m * 1e6
    return Plan(
        model_params=model.num_params, weights_bytes=weights, kv_bytes_per_token=kv_per_token,
        kv_memory_bytes=kv_memory, max_kv_tokens=max_kv_tokens, max_concurrent_sequences=max_sequences,
        concurrency=concurrency, decode_tokens_per_s_bound=1 / step_one * inputs.efficiency,
        aggregate_decode_tokens_per_s_bound=aggregate, decode_bound_by=bound_by,
        prefill_tokens_per_s_bound=prefill, cost_per_hour=price, cost_per_1m_tokens=cost_per_1m,
        cost_per_1m_tokens_at_utilization=cost_per_1m / inputs.utilization, utilization=inputs.utilization,
        efficiency=inputs.efficiency,
        monthly_capacity_tokens=capacity, break_even_tokens_per_month=break_even,
    )


def decode_step_seconds(model: ModelMath, inputs: PlanInputs, batch: int, bandwidth: float,
                        flops: float, context: int | None = None) -> tuple[float, str]:
    """Roofline time of one decode step for `batch` sequences at `context` tokens (default: the
    plan's context), and which roof binds. bandwidth and flops are summed over all devices."""
    context = inputs.context if context is None else context
    bytes_read = (model.weight_bytes(inputs.dtype, inputs.weight_quant)
                  + batch * context * model.kv_bytes_per_token(inputs.kv_dtype))
    memory_time = bytes_read / bandwidth
    compute_time = batch * model.flops_per_token(context) / flops
    return (memory_time, "memory") if memory_time >= compute_time else (compute_time, "compute")


def batch_run_seconds(model: ModelMath, inputs: PlanInputs, num_prompts: int, prompt_len: int,
                      output_len: int) -> float:
    """Roofline time to prefill num_prompts prompts and decode output_len tokens for all of them at once."""
    acc, tp = inputs.accelerator, inputs.tensor_parallel
    bandwidth, flops = acc.bandwidth_gbs * 1e9 * tp, acc.bf16_tflops * 1e12 * tp
    prefill = num_prompts * prompt_len * model.flops_per_token(prompt_len // 2) / flops
    decode = sum(decode_step_seconds(model, inputs, num_prompts, bandwidth, flops, prompt_len + step)[0]
                 for step in range(output_len - 1))
    return (prefill + decode) / inputs.efficiency
