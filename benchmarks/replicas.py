"""One engine on every core against data-parallel replicas, on the default model, in one run.

  dp1          `tokenmill serve` (one engine process, all cores)
  dp2          `tokenmill serve --data-parallel-size 2` (one core each), cache-aware routing
  dp2-rr       the same with --routing round_robin

Each server runs alone, one after the other, and gets the same two workloads from tokenmill's
streaming client:
  W3       64 random 256-token prompts -> 128 tokens, 16 at a time (no prefix in common)
  prefix   8 long system prompts x 8 questions each, shuffled, 8 at a time -> 32 tokens
Prints a table (throughput, TTFT p50/p99, the prefix-cache hit rate of the prefix workload from
the server's own /metrics) and one JSON line with ratios against dp1. Not in CI. Usage:

    .venv/bin/python benchmarks/replicas.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.bench.serve import BenchRequest, random_requests, run_load, served_model_name, summarize  # noqa: E402

SERVERS = {"dp1": [], "dp2": ["--data-parallel-size", "2"],
           "dp2-rr": ["--data-parallel-size", "2", "--routing", "round_robin"]}
TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "glass", "clocks"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def start(name: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--log-level", "warning",
               *SERVERS[name]]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{name}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"{name}: the server did not become ready")


def prefix_requests(salt: int, questions: int, output_len: int) -> list[BenchRequest]:
    requests = []
    for topic in TOPICS:
        facts = " ".join(f"Fact {i} about {topic}: {topic} have property number {i * 7 + salt}." for i in range(40))
        system = f"You are an expert on {topic} ({salt}). {facts} Answer briefly."
        requests += [BenchRequest(f"{system}\nQuestion {q}: what about {topic}?\nAnswer:", output_len)
                     for q in range(questions)]
    random.Random(salt).shuffle(requests)
    return requests


def load(base_url: str, model: str, requests: list[BenchRequest], concurrency: int) -> dict:
    records, elapsed = asyncio.run(run_load(base_url, model, requests, float("inf"), concurrency, None, seed=0))
    report = summarize(records, elapsed, None, None, None)
    if report["failed"]:
        raise SystemExit(f"{report['failed']} requests failed, first: {report['errors'][0]}")
    return report


def run_server(name: str, args: argparse.Namespace, salt: int) -> dict:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    process = start(name, port)
    try:
        model = served_model_name(base_url, None, None)
        load(base_url, model, random_requests(8, 64, 8, 30000, seed=salt), 4)  # warm-up
        w3 = load(base_url, model, random_requests(args.num, 256, args.output_len, 30000, seed=salt + 1), 16)
        hits, queries = (metric(base_url, "tokenmill:prefix_cache_hits_total"),
                         metric(base_url, "tokenmill:prefix_cache_queries_total"))
        prefix = load(base_url, model, prefix_requests(salt, args.questions, 32), 8)
        hit_rate = ((metric(base_url, "tokenmill:prefix_cache_hits_total") - hits)
                    / (metric(base_url, "tokenmill:prefix_cache_queries_total") - queries))
    finally:
        process.terminate()
        process.wait(60)
    return {"server": name, "w3_total_tps": w3["total_token_throughput"], "w3_output_tps": w3["output_throughput"],
            "w3_ttft_p50_ms": w3["ttft_ms"]["median"], "w3_ttft_p99_ms": w3["ttft_ms"]["p99"],
            "prefix_total_tps": prefix["total_token_throughput"], "prefix_ttft_p50_ms": prefix["ttft_ms"]["median"],
            "prefix_ttft_p99_ms": prefix["ttft_ms"]["p99"], "prefix_hit_rate": hit_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 W3 prompts x 32 tokens, 4 questions per prompt")
    parser.add_argument("--servers", nargs="*", default=list(SERVERS), choices=list(SERVERS))
    args = parser.parse_args()
    args.num, args.output_len, args.questions = (16, 32, 4) if args.quick else (64, 128, 8)
    results = [run_server(name, args, salt=100 * i + 1) for i, name in enumerate(args.servers)]
    columns = [("w3_total_tps", "W3 total", ".0f"), ("w3_output_tps", "W3 out", ".0f"),
               ("w3_ttft_p50_ms", "W3 TTFT p50", ".0f"), ("w3_ttft_p99_ms", "W3 TTFT p99", ".0f"),
               ("prefix_total_tps", "prefix total", ".0f"), ("prefix_ttft_p50_ms", "prefix p50", ".0f"),
               ("prefix_ttft_p99_ms", "prefix p99", ".0f"), ("prefix_hit_rate", "hit rate", ".3f")]
    print(f"\n{'server':<8}" + "".join(f"{title:>14}" for _, title, _ in columns))
    for r in results:
        print(f"{r['server']:<8}" + "".join(f"{r[key]:>14{fmt}}" for key, _, fmt in columns))
    base = next((r for r in results if r["server"] == "dp1"), None)
    ratios = {}
    if base is not None:
        for r in results:
            if r is not base:
                ratios.update({f"{key}_{r['server']}_over_dp1": r[key] / base[key] if base[key] else None
                               for key, _, _ in columns})
    print(json.dumps({"benchmark": "replicas", "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
