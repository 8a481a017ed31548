"""`tokenmill plan`: arguments -> PlanInputs -> Plan -> a readable table or one JSON object."""

from __future__ import annotations

import argparse
import json

from tokenmill.hardware import Accelerator, lookup
from tokenmill.models.model_math import ModelMath
from tokenmill.plan.planner import (
    CPU_EFFICIENCY, CPU_KV_FRACTION, GPU_EFFICIENCY, PlanInputs, batch_run_seconds, make_plan,
)


def add_parser(sub) -> None:
    plan = sub.add_parser("plan", help="memory, throughput bounds and cost of serving a model")
    plan.add_argument("--model", default=None, help="HF directory, config.json or .gguf (default: the default model)")
    plan.add_argument("--gpu", default=None, help="catalog accelerator (L4, A10G, A100-40GB, A100-80GB, H100-SXM, "
                                                  "H200, MI300X) or 'cpu' (this machine, measured once)")
    plan.add_argument("--memory-gb", type=float, default=None)
    plan.add_argument("--bandwidth-gbs", type=float, default=None)
    plan.add_argument("--tflops", type=float, default=None, help="dense bf16 TFLOP/s")
    plan.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    plan.add_argument("--weight-quant", default=None, choices=["int8", "int4"])
    plan.add_argument("--kv-cache-dtype", default=None, choices=["bfloat16", "float16", "float32"],
                      help="what the KV cache holds (default: --dtype; serve keeps float16 under float32 on AVX2 CPUs)")
    plan.add_argument("--context", type=int, default=4096, help="tokens per sequence (prompt + output)")
    plan.add_argument("--concurrency", type=int, default=None, help="sequences decoding together (default: all that fit)")
    plan.add_argument("--cost-per-hour", type=float, default=None, help="per device (default: catalog price)")
    plan.add_argument("--api-price-per-1m", type=float, default=None, help="managed API price per 1M output tokens")
    plan.add_argument("--tensor-parallel", type=int, default=1)
    plan.add_argument("--utilization", type=float, default=0.5, help="share of the time the server is busy")
    plan.add_argument("--efficiency", type=float, default=None,
                      help="share of the roofline an engine reaches (default: 0.5 on CPU, 0.6 on GPUs; 1 = the bound)")
    plan.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool per device (default: the engine's)")
    plan.add_argument("--batch-workload", default=None, metavar="PROMPTSxPROMPT_LENxOUTPUT_LEN",
                      help="also estimate one offline batch, e.g. 64x256x128")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill.models.loader import load_model_config
    from tokenmill.models.model_files import resolve_model_path

    model_path = resolve_model_path(args.model)
    model = ModelMath(load_model_config(model_path))
    accelerator = _accelerator(args)
    kv_memory = None if args.kv_memory_gb is None else args.kv_memory_gb * 1e9
    if kv_memory is None and accelerator.name == "cpu":  # the engine's default: a share of what is free now
        import torch

        from tokenmill.platform import available_memory_bytes

        kv_memory = CPU_KV_FRACTION * available_memory_bytes(torch.device("cpu"))
    efficiency = args.efficiency or (CPU_EFFICIENCY if accelerator.name == "cpu" else GPU_EFFICIENCY)
    inputs = PlanInputs(
        accelerator=accelerator, dtype=args.dtype, weight_quant=args.weight_quant, context=args.context,
        concurrency=args.concurrency, cost_per_hour=args.cost_per_hour, api_price_per_1m=args.api_price_per_1m,
        tensor_parallel=args.tensor_parallel, utilization=args.utilization, efficiency=efficiency,
        kv_memory_bytes=kv_memory, kv_cache_dtype=args.kv_cache_dtype,
    )
    result = make_plan(model, inputs).to_dict()
    result["accelerator"] = accelerator.__dict__
    if args.batch_workload:
        num_prompts, prompt_len, output_len = _parse_workload(args.batch_workload)
        seconds = batch_run_seconds(model, inputs, num_prompts, prompt_len, output_len)
        result["batch_workload"] = {
            "num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len, "seconds": seconds,
            "output_tokens_per_s": num_prompts * output_len / seconds,
            "total_tokens_per_s": num_prompts * (prompt_len + output_len) / seconds,
        }
    print(json.dumps(result) if args.json else _render(str(model_path), result))
    return 0


def _accelerator(args: argparse.Namespace) -> Accelerator:
    overrides = {"memory_gb": args.memory_gb, "bandwidth_gbs": args.bandwidth_gbs, "bf16_tflops": args.tflops}
    if args.gpu:
        return lookup(args.gpu).with_overrides(**overrides)
    if all(v is not None for v in overrides.values()):
        return Accelerator("custom", price_per_hour=args.cost_per_hour or 0.0, **overrides)
    return lookup("cpu").with_overrides(**overrides)


def _parse_workload(text: str) -> tuple[int, int, int]:
    from tokenmill.errors import InvalidParameterError

    try:
        a, b, c = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise InvalidParameterError("--batch-workload looks like 64x256x128") from None
    return a, b, c


def _render(model_path: str, r: dict) -> str:
    acc = r["accelerator"]
    gb = 1e9
    lines = [
        f"model                      {model_path} ({r['model_params'] / 1e6:,.1f} M parameters)",
        f"accelerator                {acc['name']}: {acc['memory_gb']:.0f} GB, {acc['bandwidth_gbs']:,.0f} GB/s, "
        f"{acc['bf16_tflops']:,.3g} TFLOP/s",
        f"weights per device         {r['weights_bytes'] / gb:,.2f} GB",
        f"KV cache per token         {r['kv_bytes_per_token']:,.0f} bytes",
        f"KV pool per device         {r['kv_memory_bytes'] / gb:,.2f} GB = {r['max_kv_tokens']:,} tokens",
        f"sequences that fit         {r['max_concurrent_sequences']:,}",
        f"decode bound, 1 sequence   {r['decode_tokens_per_s_bound']:,.1f} tokens/s",
        f"{'decode bound, ' + format(r['concurrency'], ',') + ' seqs':<27}"
        f"{r['aggregate_decode_tokens_per_s_bound']:,.1f} tokens/s ({r['decode_bound_by']}-bound)",
        f"prefill bound              {r['prefill_tokens_per_s_bound']:,.0f} tokens/s",
        f"(bounds x efficiency {r['efficiency']:g})",
        f"cost                       ${r['cost_per_hour']:.2f}/h: ${r['cost_per_1m_tokens']:.4f} per 1M output tokens "
        f"at full use, ${r['cost_per_1m_tokens_at_utilization']:.4f} at {r['utilization']:.0%}",
        f"monthly capacity           {r['monthly_capacity_tokens']:,.3g} output tokens",
    ]
    if r["break_even_tokens_per_month"] is not None:
        verdict = "" if r["break_even_tokens_per_month"] <= r["monthly_capacity_tokens"] else \
            " (more than this setup can serve: the API stays cheaper)"
        lines.append(f"break-even vs API          {r['break_even_tokens_per_month']:,.3g} output tokens/month{verdict}")
    if "batch_workload" in r:
        w = r["batch_workload"]
        lines.append(f"batch {w['num_prompts']}x{w['prompt_len']}->{w['output_len']:<12}{w['seconds']:.1f} s: "
                     f"{w['output_tokens_per_s']:,.0f} output, {w['total_tokens_per_s']:,.0f} total tokens/s")
    return "\n".join(lines)
