"""Structured outputs under load: `tokenmill serve` on the default model, 32 concurrent chat
requests with a JSON schema each (32 different schemas, so each compiles) vs the same 32 requests
without one.

The unconstrained phase asks each request for exactly as many tokens as its constrained twin
produced (ignore_eos), on a prompt of the same length that hits no cache, so both phases do the
same work and the ratio of their rates is the cost of the masks. Also: schema compile time p50/p99 (in process, the same schemas,
cold cache) and the share of constrained outputs that validate.
Targets: constrained >= 0.9x unconstrained tokens/s; 100% valid.

    python benchmarks/structured.py [--base-url URL] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).parent))
from serve_latency import start_server  # noqa: E402

TOPICS = ["a city", "a river", "a mountain", "a book", "a planet", "a bird", "a painting", "a bridge"]


def schema(i: int) -> dict:
    """Schema i: the same shape, other property names (so no two share a compiled grammar)."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f"name_{i}": {"type": "string", "maxLength": 40},
                           f"facts_{i}": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 60}},
                           f"rating_{i}": {"type": "integer", "minimum": 1, "maximum": 10},
                           f"kind_{i}": {"enum": ["natural", "made", "other"]}},
            "required": [f"name_{i}", f"facts_{i}", f"rating_{i}", f"kind_{i}"]}


def messages(i: int, phase: int) -> list[dict]:
    """Each phase asks the same with another number (of as many digits): no prefix-cache hits
    from one phase to another."""
    return [{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} (number {phase}{i:02d}) as JSON."}]


async def run_phase(client: openai.AsyncOpenAI, model: str, requests: list[dict]) -> tuple[float, list]:
    start = time.perf_counter()
    replies = await asyncio.gather(*(client.chat.completions.create(model=model, temperature=0, **r)
                                     for r in requests))
    return time.perf_counter() - start, replies


def compile_times_ms(num: int) -> list[float]:
    from tokenmill.engine.structured_output import GrammarCompiler
    from tokenmill.models.loader import load_model_config
    from tokenmill.models.model_files import default_model_path, load_tokenizer
    from tokenmill.sampling_params import StructuredOutputsParams

    config, tokenizer = load_model_config(default_model_path()), load_tokenizer(default_model_path())
    compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)
    compiler.prepare()
    times = []
    for i in range(num):
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json=schema(1000 + i)))
        times.append((time.perf_counter() - start) * 1e3)
    return times


async def one_round(client: openai.AsyncOpenAI, model: str, args: argparse.Namespace, round_index: int) -> dict:
    n = args.concurrency
    first = 100 * round_index  # new schemas and prompts each round: every grammar compiles, no cache hits
    constrained_requests = [{"messages": messages(i, 2 * round_index + 1), "max_tokens": args.max_tokens,
                             "response_format": {"type": "json_schema",
                                                 "json_schema": {"name": f"s{i}", "schema": schema(first + i)}}}
                            for i in range(n)]
    constrained_s, constrained = await run_phase(client, model, constrained_requests)
    lengths = [r.usage.completion_tokens for r in constrained]
    free_requests = [{"messages": messages(i, 2 * round_index + 2), "max_tokens": lengths[i],
                      "extra_body": {"ignore_eos": True}} for i in range(n)]
    free_s, free = await run_phase(client, model, free_requests)
    valid = 0
    for i, reply in enumerate(constrained):
        try:
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema(first + i))
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"request {i} ({reply.choices[0].finish_reason}) does not validate ({type(exc).__name__}): "
                  f"{reply.choices[0].message.content[:300]!r}")
    tokens = sum(lengths)
    free_tokens = sum(r.usage.completion_tokens for r in free)
    return {"tokens": tokens, "constrained_s": constrained_s, "unconstrained_s": free_s,
            "constrained_tps": tokens / constrained_s, "unconstrained_tps": free_tokens / free_s,
            "ratio": (tokens / constrained_s) / (free_tokens / free_s), "valid": valid,
            "finish_reasons": sorted({r.choices[0].finish_reason for r in constrained})}


async def main_async(args: argparse.Namespace, base_url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    await run_phase(client, model, [{"messages": messages(0, 9), "max_tokens": 8}])  # warm-up
    rounds = [await one_round(client, model, args, r) for r in range(args.rounds)]
    return {"concurrency": args.concurrency, "rounds": rounds,
            "ratio": statistics.median(r["ratio"] for r in rounds),
            "valid_share": sum(r["valid"] for r in rounds) / (args.concurrency * args.rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start one on --port)")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3, help="constrained/unconstrained pairs (the machine drifts)")
    args = parser.parse_args()
    process = None if args.base_url else start_server(args.port)
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    try:
        result = asyncio.run(main_async(args, base_url))
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    times = compile_times_ms(args.concurrency)
    result["compile_ms_p50"] = statistics.median(times)
    result["compile_ms_p99"] = sorted(times)[int(0.99 * (len(times) - 1))]
    print(f"\n{args.concurrency} concurrent chat requests, default model; each round: with a JSON schema, then "
          "the same number of tokens without")
    print(f"{'round':<7}{'tokens':>8}{'schema s':>10}{'tok/s':>8}{'plain s':>9}{'tok/s':>8}{'ratio':>7}{'valid':>7}")
    for i, r in enumerate(result["rounds"]):
        print(f"{i:<7}{r['tokens']:>8}{r['constrained_s']:>10.2f}{r['constrained_tps']:>8.1f}"
              f"{r['unconstrained_s']:>9.2f}{r['unconstrained_tps']:>8.1f}{r['ratio']:>7.3f}"
              f"{r['valid']:>4}/{args.concurrency}")
    print(f"constrained / unconstrained, median of rounds: {result['ratio']:.3f} (target >= 0.9)")
    print(f"valid outputs: {result['valid_share']:.0%} (target 100%)")
    print(f"schema compile: p50 {result['compile_ms_p50']:.1f} ms, p99 {result['compile_ms_p99']:.1f} ms\n")
    print(json.dumps({"benchmark": "structured", **result}))


if __name__ == "__main__":
    main()
