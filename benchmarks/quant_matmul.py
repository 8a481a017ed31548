"""The quantized linears alone: the default model's first layer, as the loader left it for this CPU.

For each of its linears (qkv, o, gate_up, down) and each batch of M rows (1 = one decode step,
64 = a decode batch, 512 and 2048 = prompts: a 2048-token prefill step is where W3's first tokens
wait), times the layer's own forward (the kernel its weights and rounding choose: quant_gemv_i8 on
AVX2, the VNNI / AMX kernels on AVX-512) against the same product through oneDNN on the dequantized
weight in the model's dtype, the baseline, in the same run: best of --repeats, interleaved. Prints a
table (ms, GFLOP/s, ratio) and one JSON line. Not a test: this machine's speed drifts, so read the
ratios, not the absolute figures. Usage:
    python benchmarks/quant_matmul.py [--rows 1 64 512 2048] [--repeats 7] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def first_layer_linears(dtype: torch.dtype, dtype_was_auto: bool) -> dict[str, torch.nn.Module]:
    from tokenmill.layers.quantized import QuantizedLinear
    from tokenmill.models.loader import load_model

    loaded = load_model(None, dtype, torch.device("cpu"), max_model_len=4096, tokenizer="none",
                        dtype_was_auto=dtype_was_auto)
    layer = loaded.model.layers[0]
    found = {name.rsplit(".", 1)[-1]: module for name, module in layer.named_modules()
             if isinstance(module, QuantizedLinear)}
    if not found:
        raise SystemExit("the default model's linears are not quantized here (--quantization none?)")
    return found


def best_seconds(run, x: torch.Tensor, repeats: int) -> float:
    run(x)  # warm: a first call may allocate or pack
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x)
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512, 2048])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="auto", help="auto (what the engine picks here), bfloat16, float32")
    args = parser.parse_args()
    from tokenmill.platform import resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"), quantized_weights=True)
    linears = first_layer_linears(dtype, args.dtype == "auto")
    torch.manual_seed(0)
    results = []
    print(f"\n{'linear':<13}{'N x K':>12}{'M':>6}{'ours ms':>10}{'GFLOP/s':>9}{'oneDNN ms':>11}{'GFLOP/s':>9}"
          f"{'ours/oneDNN':>13}")
    for name, module in linears.items():
        dense = module.qweight.dequantize(dtype)
        n, k = dense.shape
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype)
            ours = baseline = float("inf")
            for _ in range(2):  # interleaved, so that a slow minute hits both
                ours = min(ours, best_seconds(module, x, args.repeats))
                baseline = min(baseline, best_seconds(lambda t: F.linear(t, dense), x, args.repeats))
            flops = 2 * m * n * k
            results.append({"linear": name, "n": n, "k": k, "rows": m, "ours_ms": ours * 1e3,
                            "onednn_ms": baseline * 1e3, "ours_gflops": flops / ours / 1e9,
                            "onednn_gflops": flops / baseline / 1e9, "speedup_vs_onednn": baseline / ours})
            r = results[-1]
            print(f"{name:<13}{f'{n} x {k}':>12}{m:>6}{r['ours_ms']:>10.2f}{r['ours_gflops']:>9.1f}"
                  f"{r['onednn_ms']:>11.2f}{r['onednn_gflops']:>9.1f}{r['speedup_vs_onednn']:>12.2f}x")
    totals = {}
    for m in args.rows:
        ours = sum(r["ours_ms"] for r in results if r["rows"] == m)
        base = sum(r["onednn_ms"] for r in results if r["rows"] == m)
        flops = sum(2 * m * r["n"] * r["k"] for r in results if r["rows"] == m)
        totals[m] = {"ours_ms": ours, "onednn_ms": base, "ours_gflops": flops / ours / 1e6,
                     "speedup_vs_onednn": base / ours}
        print(f"{'layer':<13}{'':>12}{m:>6}{ours:>10.2f}{flops / ours / 1e6:>9.1f}{base:>11.2f}"
              f"{flops / base / 1e6:>9.1f}{base / ours:>12.2f}x")
    print(json.dumps({"benchmark": "quant_matmul", "dtype": str(dtype).removeprefix("torch."),
                      "weights": type(next(iter(linears.values())).qweight).__name__, "results": results,
                      "layer": totals}))


if __name__ == "__main__":
    main()
