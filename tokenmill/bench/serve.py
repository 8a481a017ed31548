"""`tokenmill bench serve`: drive any OpenAI-compatible server with streamed completions and report
throughput, latency percentiles, goodput under SLOs and cost per token.

Requests go to /v1/completions (random token-id prompts, or a JSONL file of {"prompt", "max_tokens"}),
arriving as a Poisson process at --request-rate (or all at once), at most --max-concurrency in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass

from tokenmill.bench.sse_client import StreamRecord, stream_request
from tokenmill.errors import InvalidParameterError


# Random prompts use token ids below this: every supported family's vocabulary is larger.
RANDOM_TOKEN_ID_LIMIT = 30000


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int


def random_requests(num: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(100, vocab_size) for _ in range(input_len)], output_len) for _ in range(num)]


def jsonl_requests(path: str, num: int, output_len: int) -> list[BenchRequest]:
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(BenchRequest(row["prompt"], int(row.get("max_tokens", output_len))))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidParameterError(f"{path}:{line_no}: expected {{\"prompt\": ...}}: {exc}") from None
    if not requests:
        raise InvalidParameterError(f"{path} holds no requests")
    return (requests * (num // len(requests) + 1))[:num]


async def run_load(base_url: str, model: str, requests: list[BenchRequest], request_rate: float,
                   max_concurrency: int | None, api_key: str | None, seed: int,
                   progress=None, extra_body: dict | None = None) -> tuple[list[StreamRecord], float]:
    """Send every request (Poisson arrivals, capped concurrency); returns the records and the duration.
    extra_body: more fields for every request (a peer's own options, e.g. llama.cpp's cache_prompt)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency or len(requests))

    async def one(request: BenchRequest) -> StreamRecord:
        async with gate:
            body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens,
                    "ignore_eos": True, "temperature": 0, **(extra_body or {})}
            record = await stream_request(base_url, "/v1/completions", body, api_key)
        if progress is not None:
            progress.update(1)
        return record

    start = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(request)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    records = await asyncio.gather(*tasks)
    return records, time.perf_counter() - start


def summarize(records: list[StreamRecord], duration: float, slo_ttft_ms: float | None,
              slo_itl_ms: float | None, cost_per_hour: float | None) -> dict:
    """The report: counts, throughput, latency stats in ms, goodput, cost."""
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    report = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "ttft_ms": _stats([r.ttft for r in done]),
        "tpot_ms": _stats(tpots),
        "itl_ms": _stats([gap for r in done for gap in r.itls]),
        "e2e_ms": _stats([r.e2e for r in done]),
    }
    good = [r for r in done if _meets_slo(r, slo_ttft_ms, slo_itl_ms)]
    report["slo"] = {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms}
    report["goodput_requests_per_s"] = len(good) / duration
    report["good_fraction"] = len(good) / len(records) if records else 0.0
    if cost_per_hour is not None and output_tokens:
        dollars = cost_per_hour * duration / 3600
        report["cost_per_1m_output_tokens"] = dollars / output_tokens * 1e6
        report["cost_per_1m_total_tokens"] = dollars / (prompt_tokens + output_tokens) * 1e6
    return report


def _meets_slo(record: StreamRecord, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
    if slo_ttft_ms is not None and record.ttft * 1000 > slo_ttft_ms:
        return False
    if slo_itl_ms is not None and record.output_tokens > 1:
        tpot = (record.e2e - record.ttft) / (record.output_tokens - 1)
        return tpot * 1000 <= slo_itl_ms
    return True


def _stats(seconds: list[float]) -> dict:
    if not seconds:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    ordered = sorted(s * 1000 for s in seconds)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]

    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p90": pct(90), "p99": pct(99)}


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name (default: the server's first model)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset", default="random", help="'random' or a JSONL file of {\"prompt\", \"max_tokens\"}")
    serve.add_argument("--input-len", type=int, default=256)
    serve.add_argument("--output-len", type=int, default=128)
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf = all at once")
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--slo-ttft-ms", type=float, default=None)
    serve.add_argument("--slo-itl-ms", type=float, default=None, help="bound on each request's mean inter-token time")
    serve.add_argument("--cost-per-hour", type=float, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--json", default=None, metavar="OUT")
    serve.add_argument("--plot", default=None, metavar="OUT.png", help="latency CDFs and throughput over time")
    serve.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.plot:
        _require_matplotlib()
    model = served_model_name(args.base_url, args.model, args.api_key)
    if args.dataset == "random":
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, RANDOM_TOKEN_ID_LIMIT,
                                   args.seed)
    else:
        requests = jsonl_requests(args.dataset, args.num_prompts, args.output_len)
    with tqdm(total=len(requests), desc="bench serve", unit="req", dynamic_ncols=True) as progress:
        records, duration = asyncio.run(run_load(args.base_url, model, requests, args.request_rate,
                                                 args.max_concurrency, args.api_key, args.seed, progress))
    report = summarize(records, duration, args.slo_ttft_ms, args.slo_itl_ms, args.cost_per_hour)
    report.update({"benchmark": "serve", "base_url": args.base_url, "model": model, "dataset": args.dataset,
                   "num_prompts": len(requests), "request_rate": args.request_rate,
                   "max_concurrency": args.max_concurrency})
    print(_render(report))
    print(json.dumps(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        from tokenmill.bench.plot import plot_records

        plot_records(records, args.plot)
    return 0 if report["completed"] else 1


def served_model_name(base_url: str, model: str | None, api_key: str | None) -> str:
    """The model to ask for: the one given, else the server's first."""
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.load(response)["data"]
    return model or models[0]["id"]


def _render(r: dict) -> str:
    lines = [
        f"completed / failed          {r['completed']} / {r['failed']}",
        f"duration                    {r['duration_s']:.2f} s",
        f"requests/s                  {r['request_throughput']:.2f}",
        f"output tokens/s             {r['output_throughput']:.1f}",
        f"total tokens/s              {r['total_token_throughput']:.1f}",
        f"{'ms':<28}{'mean':>9}{'median':>9}{'p90':>9}{'p99':>9}",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[key]
        if s["mean"] is not None:
            lines.append(f"{key[:-3].upper():<28}{s['mean']:>9.1f}{s['median']:>9.1f}{s['p90']:>9.1f}{s['p99']:>9.1f}")
    lines.append(f"goodput                     {r['goodput_requests_per_s']:.2f} req/s "
                 f"({r['good_fraction']:.0%} within SLO)")
    if "cost_per_1m_output_tokens" in r:
        lines.append(f"cost                        ${r['cost_per_1m_output_tokens']:.4f} per 1M output tokens, "
                     f"${r['cost_per_1m_total_tokens']:.4f} per 1M total")
    return "\n".join(lines)


def _require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidParameterError("--plot needs matplotlib: pip install 'tokenmill[plot]'")
