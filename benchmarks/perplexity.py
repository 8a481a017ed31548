"""What quantized weights cost in quality: perplexity of the default model on benchmarks/data/mills.txt.

Weights, all run in this CPU's default dtype (bfloat16 where it has native bf16, else float32; or
--dtype):
  bf16   the GGUF dequantized (--quantization none), held in that dtype: the reference
  Q4_1   the GGUF's own weights, kept quantized (the default): the same values as bf16, so any
         difference is our kernels' (8-bit activations on AVX-512 VNNI CPUs)
  int8   the bf16 weights re-quantized at load, round-to-nearest, groups of 32
  int4   the same in 4 bits
Each is scored twice on the same windows: fed 8 tokens at a time (every linear sees <= 8 rows: the
decode kernels, the path generation takes) and a whole window at once (the batched path, prefill).
Targets: int8 within 1% of bf16, int4 and Q4_1 within 5%. --activation-bits 8 or 16 gives every
quantized linear that rounding of its activations instead of the loader's choice for this CPU and
--dtype (on the AVX2 build: 8 bits where --dtype auto chose float32, 16 where float32 is asked for). Prints a table and
one JSON line. Usage:
    python benchmarks/perplexity.py [--windows 8] [--window-len 512] [--dtype D] [--activation-bits B]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data" / "mills.txt"
BLOCK_SIZE = 16
TARGETS = {"int8": 0.01, "int4": 0.05, "Q4_1": 0.05}
WEIGHTS = {"bf16": "none", "Q4_1": None, "int8": "int8", "int4": "int4"}


def windows(num: int, length: int) -> list[list[int]]:
    from tokenmill.models.model_files import default_model_path, load_tokenizer

    ids = load_tokenizer(default_model_path())(DATA.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    stride = (len(ids) - length) // max(1, num - 1)
    return [ids[i * stride : i * stride + length] for i in range(num)]


@torch.inference_mode()
def negative_log_likelihood(quantization: str | None, texts: list[list[int]], chunk: int, dtype: torch.dtype,
                            activation_bits: int | None, dtype_was_auto: bool = False) -> tuple[float, int]:
    """Summed NLL of every next token of every window, and how many tokens that is."""
    from tokenmill.layers.attention import AttentionContext, CacheGeometry
    from tokenmill.layers.cpu_attention import default_attention_backend
    from tokenmill.layers.quantized import QuantizedLinear
    from tokenmill.models.loader import load_model

    cpu = torch.device("cpu")
    length = max(len(t) for t in texts)
    loaded = load_model(None, dtype, cpu, max_model_len=length + BLOCK_SIZE, tokenizer="none",
                        quantization=quantization, dtype_was_auto=dtype_was_auto)
    model, config = loaded.model, loaded.config
    if activation_bits is not None:
        for module in model.modules():
            if isinstance(module, QuantizedLinear) and module.activation_bits is not None:
                module.activation_bits = activation_bits
    backend = default_attention_backend(cpu, dtype, config.head_dim, config.num_query_groups)
    num_blocks = -(-length // BLOCK_SIZE)
    geometry = CacheGeometry(BLOCK_SIZE, num_blocks, config.num_key_value_heads, config.num_query_groups,
                             config.head_dim, dtype, cpu)
    kv = torch.zeros(config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, BLOCK_SIZE,
                     config.head_dim, dtype=dtype)
    kv_caches = [(layer[0], layer[1]) for layer in kv]
    table = list(range(num_blocks))
    total, count = 0.0, 0
    for text in texts:
        logits = []
        for start in range(0, len(text), chunk):
            piece = text[start : start + chunk]
            metadata = backend.build_metadata([len(piece)], [start], [table], geometry)
            hidden = model(torch.tensor(piece), metadata.positions, AttentionContext(backend, metadata, kv_caches))
            logits.append(model.compute_logits(hidden))
        log_probs = torch.log_softmax(torch.cat(logits)[:-1].float(), dim=-1)
        targets = torch.tensor(text[1:])
        total -= float(log_probs.gather(1, targets[:, None]).sum())
        count += len(targets)
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window-len", type=int, default=512)
    parser.add_argument("--decode-chunk", type=int, default=8)
    parser.add_argument("--dtype", default="auto", help="auto (this CPU's default), bfloat16, float32, float16")
    parser.add_argument("--activation-bits", type=int, choices=[8, 16], default=None)
    args = parser.parse_args()
    from tokenmill.platform import resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    texts = windows(args.windows, args.window_len)
    rows = {}
    for name, quantization in WEIGHTS.items():
        rows[name] = {}
        for path, chunk in (("decode", args.decode_chunk), ("prefill", args.window_len)):
            nll, count = negative_log_likelihood(quantization, texts, chunk, dtype, args.activation_bits,
                                                 dtype_was_auto=args.dtype == "auto")
            rows[name][path] = math.exp(nll / count)
    base = rows["bf16"]
    bits = "the loader's" if args.activation_bits is None else f"{args.activation_bits}-bit"
    print(f"\nperplexity, {args.windows} windows x {args.window_len} tokens of {DATA.name}, {str(dtype)[6:]}, "
          f"{bits} activations")
    print(f"{'weights':<8}{'decode path':>13}{'vs bf16':>9}{'prefill path':>14}{'vs bf16':>9}{'target':>9}")
    report = {}
    for name, row in rows.items():
        rel = {path: row[path] / base[path] - 1 for path in row}
        target = TARGETS.get(name)
        report[name] = {**row, "decode_vs_bf16": rel["decode"], "prefill_vs_bf16": rel["prefill"],
                        "within_target": None if target is None else max(rel.values()) <= target}
        print(f"{name:<8}{row['decode']:>13.3f}{rel['decode']:>+9.2%}{row['prefill']:>14.3f}{rel['prefill']:>+9.2%}"
              f"{'' if target is None else f'<= {target:.0%}':>9}")
    print(json.dumps({"benchmark": "perplexity", "windows": args.windows, "window_len": args.window_len,
                      "dtype": str(dtype)[6:], "activation_bits": args.activation_bits, "results": report}))


if __name__ == "__main__":
    main()
