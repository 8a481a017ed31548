"""`tokenmill bench offline`: the same mixed workload through continuous and static batching.

The workload looks like chat traffic: prompt lengths spread evenly, answers mostly short with a
few long ones (lengths honoured with ignore_eos). Static batching forms batches of the same size
up front and runs each until its longest member finishes, as naive serving does: a padded batch
computes every row until the longest is done, so every member is generated to the batch's longest
length and only its own requested tokens count as output. Continuous batching lets sequences join
and leave every step. Both run on one engine, prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class WorkItem:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class ModeResult:
    mode: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float


def make_workload(num_prompts: int, vocab_size: int, min_prompt: int, max_prompt: int, short: tuple[int, int],
                  long: tuple[int, int], long_fraction: float, seed: int) -> list[WorkItem]:
    """Random-token prompts; output lengths drawn from a short range, or from a long one with long_fraction."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        prompt = [rng.randrange(100, vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))]
        low, high = long if rng.random() < long_fraction else short
        items.append(WorkItem(prompt, rng.randint(low, high)))
    return items


def run_mode(llm, items: list[WorkItem], mode: str, batch_size: int) -> ModeResult:
    from tokenmill import SamplingParams

    prompts = [item.prompt_token_ids for item in items]
    start = time.perf_counter()
    if mode == "continuous":
        params = [SamplingParams(temperature=0.0, max_tokens=item.output_len, ignore_eos=True) for item in items]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elif mode == "static":
        outputs = []
        for first in range(0, len(items), batch_size):  # the next batch starts when the whole last one is done
            batch = items[first:first + batch_size]
            padded = SamplingParams(temperature=0.0, max_tokens=max(i.output_len for i in batch), ignore_eos=True)
            outputs += llm.generate([i.prompt_token_ids for i in batch], padded, use_tqdm=False)
    else:
        raise ValueError(mode)
    elapsed = time.perf_counter() - start
    num_prompt = sum(len(p) for p in prompts)
    # only the tokens a request asked for are output; a static batch's padding rows are waste
    num_output = sum(min(len(o.outputs[0].token_ids), item.output_len) for o, item in zip(outputs, items))
    return ModeResult(mode, elapsed, len(items), num_prompt, num_output, num_output / elapsed,
                      (num_prompt + num_output) / elapsed, len(items) / elapsed)


def add_parser(sub) -> None:
    offline = sub.add_parser("offline", help="continuous vs static batching on one mixed workload")
    offline.add_argument("--model", default=None)
    offline.add_argument("--dtype", default="auto")
    offline.add_argument("--mode", default="both", choices=["continuous", "static", "both"])
    offline.add_argument("--num-prompts", type=int, default=128)
    offline.add_argument("--batch-size", type=int, default=32, help="max_num_seqs, and the static batch size")
    offline.add_argument("--min-prompt-len", type=int, default=16)
    offline.add_argument("--max-prompt-len", type=int, default=128)
    offline.add_argument("--short-output", default="8,48", help="range of most answers' lengths")
    offline.add_argument("--long-output", default="256,512", help="range of the long answers' lengths")
    offline.add_argument("--long-fraction", type=float, default=0.1)
    offline.add_argument("--seed", type=int, default=0)
    offline.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON")
    offline.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenmill import LLM

    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch_size, enable_prefix_caching=False)
    short, long = _range(args.short_output), _range(args.long_output)
    items = make_workload(args.num_prompts, llm.engine.model_config.vocab_size, args.min_prompt_len,
                          args.max_prompt_len, short, long, args.long_fraction, args.seed)
    llm.generate([items[0].prompt_token_ids[:8]], use_tqdm=False)  # warm-up
    modes = ["continuous", "static"] if args.mode == "both" else [args.mode]
    results = [run_mode(llm, items, mode, args.batch_size) for mode in modes]
    report = {
        "benchmark": "offline_batching", "model": str(llm.engine.model_path.name), "batch_size": args.batch_size,
        "num_prompts": args.num_prompts, "results": [asdict(r) for r in results],
    }
    if len(results) == 2:
        report["continuous_over_static"] = results[0].output_tokens_per_s / results[1].output_tokens_per_s
    print(f"{'mode':<12}{'seconds':>9}{'req/s':>8}{'output tok/s':>14}{'total tok/s':>13}")
    for r in results:
        print(f"{r.mode:<12}{r.elapsed_s:>9.2f}{r.requests_per_s:>8.2f}{r.output_tokens_per_s:>14.1f}"
              f"{r.total_tokens_per_s:>13.1f}")
    if "continuous_over_static" in report:
        print(f"continuous / static output tokens/s: {report['continuous_over_static']:.2f}x")
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


def _range(text: str) -> tuple[int, int]:
    from tokenmill.errors import InvalidParameterError

    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise InvalidParameterError(f"expected LOW,HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise InvalidParameterError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return low, high
