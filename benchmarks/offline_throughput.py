"""Offline throughput: tokenmill vs HF transformers on the default model, same weights, same run.

W1: one 128-token prompt -> 128 tokens (single stream).
tokenmill runs with the GGUF's own Q4_1 weights (kept quantized), re-quantized to int8, and
dequantized to bf16 (--quantization none); HF always dequantizes.
W2: 64 different ~256-token prompts -> 128 tokens each, all submitted at once.
Greedy, ignore_eos. Prompts are windows of benchmarks/data/mills.txt.

Every case runs in its own subprocess (so peak RSS is per engine). Prints a table and
one JSON line with the ratios. Usage:
    python benchmarks/offline_throughput.py [--quick] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(__file__).parent / "data" / "mills.txt"


def build_prompts(tokenizer, num_prompts: int, prompt_len: int) -> list[list[int]]:
    """num_prompts windows of exactly prompt_len tokens, evenly spread over the text."""
    ids = tokenizer(DATA.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(ids) - prompt_len) // max(1, num_prompts - 1))
    prompts = [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]
    assert all(len(p) == prompt_len for p in prompts), "text too short for these prompts"
    return prompts


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---- cases (each runs in a fresh process) --------------------------------------------------
def run_tokenmill(workload: dict, dtype: str, quantization: str | None = None) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_num_batched_tokens=workload.get("max_num_batched_tokens", 2048),
              quantization=quantization)
    prompts = build_prompts(llm.get_tokenizer(), workload["num_prompts"], workload["prompt_len"])
    params = SamplingParams(temperature=0.0, max_tokens=workload["output_len"], ignore_eos=True)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    wall_start = time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - wall_start for o in outputs]
    decode_times = [o.metrics.finished_time - o.metrics.first_token_time for o in outputs]
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "engine": "tokenmill", "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "weights": {None: "Q4_1", "none": "bf16"}.get(quantization, quantization),
        "ttft_s": statistics.median(ttfts), "elapsed_s": elapsed, "output_tokens": num_out,
        "prompt_tokens": sum(len(p) for p in prompts),
        "preemptions": llm.stats().num_preemptions,
    }
    if len(prompts) == 1:
        result["decode_tps"] = (num_out - 1) / decode_times[0]
    return result


def run_hf(workload: dict, dtype: str) -> dict:
    import torch
    import transformers

    from tokenmill.models.model_files import default_model_path, load_tokenizer

    path = default_model_path()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    prompts = build_prompts(load_tokenizer(path), workload["num_prompts"], workload["prompt_len"])
    batch = torch.tensor(prompts)  # every prompt has the same length: one static batch, no padding

    first_token_at: list[float] = []

    class FirstToken(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first_token_at:
                first_token_at.append(time.perf_counter())
            return scores

    def generate(input_ids, new_tokens, processors=None):
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=2, logits_processor=processors)

    with torch.inference_mode():
        generate(batch[:1, :32], 4)  # warm-up
        start = time.perf_counter()
        out = generate(batch, workload["output_len"], transformers.LogitsProcessorList([FirstToken()]))
        elapsed = time.perf_counter() - start
    num_out = (out.shape[1] - batch.shape[1]) * batch.shape[0]
    ttft = first_token_at[0] - start
    result = {
        "engine": "transformers", "dtype": dtype, "ttft_s": ttft, "elapsed_s": elapsed,
        "output_tokens": int(num_out), "prompt_tokens": int(batch.numel()),
    }
    if len(prompts) == 1:
        result["decode_tps"] = (num_out - 1) / (elapsed - ttft)
    return result


def measure_matmul_peak() -> float:
    import torch

    a, b = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    return 2 * 2048**3 * reps / (time.perf_counter() - start) / 1e9


# ---- driver ---------------------------------------------------------------------------------
def _case_in_subprocess(engine: str, workload_name: str, workload: dict, dtype: str,
                        quantization: str | None = None) -> dict:
    case = {"engine": engine, "workload": workload, "dtype": dtype, "quantization": quantization}
    cmd = [sys.executable, __file__, "--case", json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"case {engine}/{workload_name}/{dtype} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["workload"] = workload_name
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small W2 (8 prompts, 32 tokens) to check the script")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    if args.case:
        case = json.loads(args.case)
        if case["engine"] == "tokenmill":
            result = run_tokenmill(case["workload"], case["dtype"], case.get("quantization"))
        else:
            result = run_hf(case["workload"], case["dtype"])
        result["peak_rss_mb"] = _peak_rss_mb()
        print(json.dumps(result))
        return

    w1 = {"num_prompts": 1, "prompt_len": 128, "output_len": 128}
    w2 = {"num_prompts": 64, "prompt_len": 256, "output_len": 128}
    if args.quick:
        w1, w2 = {**w1, "output_len": 16}, {"num_prompts": 8, "prompt_len": 256, "output_len": 32}
    cases = [("tokenmill", name, workload, "auto", quant) for quant in (None, "int8", "none")
             for name, workload in (("W1", w1), ("W2", w2))]
    if not args.skip_hf:
        cases += [("transformers", "W1", w1, "bfloat16", None), ("transformers", "W1", w1, "float32", None),
                  ("transformers", "W2", w2, "float32", None), ("transformers", "W2", w2, "bfloat16", None)]
    results = []
    for engine, name, workload, dtype, quant in cases:
        print(f"running {engine} {name} {dtype} {quant or ''} ...", file=sys.stderr, flush=True)
        results.append(_case_in_subprocess(engine, name, workload, dtype, quant))

    peak = measure_matmul_peak()
    print(f"\nDefault model (SmolLM2-135M-Instruct Q4_1 GGUF), {os.cpu_count()} CPUs, "
          f"bf16 matmul peak measured now: {peak:.0f} GFLOP/s\n")
    header = f"{'workload':8} {'engine':12} {'weights':8} {'dtype':9} {'TTFT s':>8} {'decode tok/s':>12} {'output tok/s':>12} " \
             f"{'total tok/s':>11} {'peak RSS MB':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        r["output_tps"] = r["output_tokens"] / r["elapsed_s"]
        r["total_tps"] = (r["output_tokens"] + r["prompt_tokens"]) / r["elapsed_s"]
        decode = f"{r['decode_tps']:12.1f}" if "decode_tps" in r else f"{'-':>12}"
        print(f"{r['workload']:8} {r['engine']:12} {r.get('weights', r['dtype']):8} {r['dtype']:9} {r['ttft_s']:8.3f} {decode} "
              f"{r['output_tps']:12.1f} {r['total_tps']:11.1f} {r['peak_rss_mb']:11.0f}")

    def find(engine, workload, dtype=None, weights=None):
        for r in results:
            if r["engine"] == engine and r["workload"] == workload and (dtype is None or r["dtype"] == dtype) \
                    and (weights is None or r.get("weights") == weights):
                return r
        return None

    summary = {"bench": "offline_throughput", "matmul_peak_gflops": round(peak, 1)}
    tm_w1, tm_w2 = find("tokenmill", "W1", weights="Q4_1"), find("tokenmill", "W2", weights="Q4_1")
    for weights in ("int8", "bf16"):
        for name in ("W1", "W2"):
            row = find("tokenmill", name, weights=weights)
            key = "decode_tps" if name == "W1" else "total_tps"
            summary[f"tokenmill_{name.lower()}_{key}_{weights}"] = round(row[key], 1)
    hf_w1_bf16, hf_w2_fp32 = find("transformers", "W1", "bfloat16"), find("transformers", "W2", "float32")
    summary["tokenmill_w2_total_tps"] = round(tm_w2["total_tps"], 1)
    summary["tokenmill_w1_decode_tps"] = round(tm_w1["decode_tps"], 1)
    if hf_w2_fp32:
        summary["w2_total_tps_ratio_vs_hf_fp32"] = round(tm_w2["total_tps"] / hf_w2_fp32["total_tps"], 2)
    if hf_w1_bf16:
        summary["w1_decode_ratio_vs_hf_bf16"] = round(tm_w1["decode_tps"] / hf_w1_bf16["decode_tps"], 2)
        summary["w1_ttft_ratio_vs_hf_bf16"] = round(tm_w1["ttft_s"] / hf_w1_bf16["ttft_s"], 2)
    print()
    print("Targets: W2 total tok/s >= 2.5x HF fp32 static batch; W1 decode >= 1.5x HF bf16 with TTFT ratio <= 1.")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
