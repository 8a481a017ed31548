"""Does `tokenmill plan` predict what the engine does on this machine?

Predicts, then measures, on the default model and this CPU:
  - KV capacity: tokens the default KV pool holds (plan: 5% of available memory / KV bytes per token);
  - W2 throughput: 64 prompts x 256 tokens -> 128 tokens each, all at once (plan --batch-workload 64x256x128,
    at the planner's default CPU efficiency).
Prints a table and one JSON line. Usage: python benchmarks/plan_vs_measured.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_prompts  # noqa: E402


def main() -> None:
    import torch

    from tokenmill import LLM, SamplingParams
    from tokenmill.hardware import this_cpu
    from tokenmill.models.loader import load_model_config
    from tokenmill.models.model_files import default_model_path
    from tokenmill.models.model_math import ModelMath
    from tokenmill.plan.planner import CPU_EFFICIENCY, CPU_KV_FRACTION, PlanInputs, batch_run_seconds, make_plan
    from tokenmill.platform import available_memory_bytes, resolve_dtype

    dtype = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    model = ModelMath(load_model_config(default_model_path()))
    inputs = PlanInputs(this_cpu(), dtype=dtype, context=384, efficiency=CPU_EFFICIENCY,
                        kv_memory_bytes=CPU_KV_FRACTION * available_memory_bytes(torch.device("cpu")))
    plan = make_plan(model, inputs)
    predicted_seconds = batch_run_seconds(model, inputs, 64, 256, 128)

    llm = LLM()
    kv = llm.stats().kv_cache
    measured_kv_tokens = kv.num_blocks * llm.engine.kv_cache.block_size
    prompts = build_prompts(llm.get_tokenizer(), 64, 256)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
    measured_seconds = time.perf_counter() - start

    rows = [
        ("KV capacity (tokens)", plan.max_kv_tokens, measured_kv_tokens),
        ("W2 output tokens/s", 64 * 128 / predicted_seconds, 64 * 128 / measured_seconds),
        ("W2 total tokens/s", 64 * 384 / predicted_seconds, 64 * 384 / measured_seconds),
    ]
    print(f"{'':<24}{'predicted':>12}{'measured':>12}{'error':>9}")
    result = {"benchmark": "plan_vs_measured", "dtype": dtype, "efficiency": CPU_EFFICIENCY}
    for name, predicted, measured in rows:
        error = predicted / measured - 1
        print(f"{name:<24}{predicted:>12,.0f}{measured:>12,.0f}{error:>+9.1%}")
        key = name.split(" (")[0].lower().replace(" ", "_").replace("/", "_per_")
        result[key] = {"predicted": predicted, "measured": measured, "error": error}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
