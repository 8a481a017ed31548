"""Decode on CUDA with and without graphs: the default model, same process, same minutes.

W1: one 128-token prompt -> 128 tokens (decode tok/s after the first token), three times each,
    alternating graphs and --enforce-eager engines.
W2: 64 x 256 -> 128 all at once (total tok/s).
Greedy, ignore_eos; prompts are windows of benchmarks/data/mills.txt. Prints a table and one
JSON line (graphs / eager). Needs a CUDA device; not in CI. Usage:
    python benchmarks/cuda_graphs.py [--rounds N] [--model PATH] [--quantization none]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from offline_throughput import build_prompts


def run(llm, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(decode tok/s of the first sequence, total tok/s)."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    first = outputs[0].metrics
    decode_tps = (len(outputs[0].outputs[0].token_ids) - 1) / (first.finished_time - first.first_token_time)
    total = sum(len(p) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outputs))
    return decode_tps, total / elapsed


def main() -> int:
    import torch

    from tokenmill import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model path (default: the default model)")
    parser.add_argument("--quantization", default=None, help="as tokenmill's (none: dequantize a GGUF at load)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("cuda_graphs.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    common = {"model": args.model, "quantization": args.quantization, "device": "cuda"}
    engines = {"graphs": LLM(**common), "eager": LLM(**common, enforce_eager=True)}
    tokenizer = engines["graphs"].get_tokenizer()
    w1 = [build_prompts(tokenizer, 3, 128)[i % 3: i % 3 + 1] for i in range(args.rounds)]
    w2 = build_prompts(tokenizer, 64, 256)
    for llm in engines.values():  # warm-up: captures the graphs these shapes need
        llm.generate(w2[:8], SamplingParams(temperature=0.0, max_tokens=130, ignore_eos=True), use_tqdm=False)
        llm.generate(w1[0], SamplingParams(temperature=0.0, max_tokens=130, ignore_eos=True), use_tqdm=False)
    w1_tps = {name: [] for name in engines}
    for prompts in w1:  # alternating, so both engines' W1 are of the same minutes
        for name, llm in engines.items():
            w1_tps[name].append(run(llm, prompts, 128)[0])
    rows = {name: (statistics.median(w1_tps[name]), run(llm, w2, 128)[1]) for name, llm in engines.items()}
    print(f"{'':8} {'W1 decode tok/s':>16} {'W2 total tok/s':>15}")
    for name, (w1_tps, w2_tps) in rows.items():
        print(f"{name:8} {w1_tps:16.1f} {w2_tps:15.1f}")
    graphs, eager = rows["graphs"], rows["eager"]
    print(json.dumps({"benchmark": "cuda_graphs", "device": torch.cuda.get_device_name(),
                      "model": args.model or "default", "quantization": args.quantization,
                      "weights": engines["graphs"].engine.weight_formats,
                      "w1_decode_tps": {"graphs": round(graphs[0], 1), "eager": round(eager[0], 1)},
                      "w2_total_tps": {"graphs": round(graphs[1], 1), "eager": round(eager[1], 1)},
                      "w1_graphs_over_eager": round(graphs[0] / eager[0], 2),
                      "w2_graphs_over_eager": round(graphs[1] / eager[1], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
