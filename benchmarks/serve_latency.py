"""Serving latency and streaming overhead of `tokenmill serve` on the default model.

W3: 64 requests, ~256-token prompts (windows of benchmarks/data/mills.txt), 128 output tokens each,
greedy, ignore_eos, streamed.
  phase "c16":  at most 16 in flight -> TTFT median/p99, ITL median, output tokens/s
  phase "all":  all 64 at once       -> output tokens/s, compared with LLM.generate offline on the
                                         same prompts in a fresh process (target: within 15%)

Starts its own server unless --base-url is given. Prints a table and one JSON line. Usage:
    python benchmarks/serve_latency.py [--base-url URL] [--num-prompts 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_prompts  # noqa: E402

from tokenmill.bench.serve import BenchRequest, run_load, served_model_name, summarize  # noqa: E402


def salted(prompts: list[list[int]], salt: int) -> list[list[int]]:
    """The same prompts with another first token, so no phase hits another phase's prefix cache."""
    return [[salt] + p[1:] for p in prompts]


async def run_phase(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    requests = [BenchRequest(prompt, output_len) for prompt in prompts]
    model = served_model_name(base_url, None, None)
    records, elapsed = await run_load(base_url, model, requests, float("inf"), concurrency, None, seed=0)
    report = summarize(records, elapsed, None, None, None)
    if report["failed"]:
        raise SystemExit(f"{report['failed']} requests failed, first: {report['errors'][0]}")
    return {
        "concurrency": concurrency, "elapsed_s": elapsed, "output_tokens": report["output_tokens"],
        "output_tps": report["output_throughput"], "ttft_median_s": report["ttft_ms"]["median"] / 1000,
        "ttft_p99_s": report["ttft_ms"]["p99"] / 1000, "itl_median_s": report["itl_ms"]["median"] / 1000,
        "itl_p99_s": report["itl_ms"]["p99"] / 1000,
    }


def offline_case(num_prompts: int, prompt_len: int, output_len: int) -> dict:
    from tokenmill import LLM, SamplingParams

    llm = LLM()
    prompts = build_prompts(llm.get_tokenizer(), num_prompts, prompt_len)
    llm.generate([prompts[0][:32]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": num_out, "output_tps": num_out / elapsed}


def start_server(port: int) -> subprocess.Popen:
    import urllib.request

    process = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
                                "--log-level", "warning"])
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server (default: start one on --port)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, for a smoke run")
    parser.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.output_len = 16, 32
    if args.offline_only:
        print(json.dumps(offline_case(args.num_prompts, args.prompt_len, args.output_len)))
        return

    from tokenmill.models.model_files import default_model_path, load_tokenizer

    prompts = build_prompts(load_tokenizer(default_model_path()), args.num_prompts, args.prompt_len)
    process = None if args.base_url else start_server(args.port)
    base_url = args.base_url or f"http://127.0.0.1:{args.port}"
    try:
        asyncio.run(run_phase(base_url, salted(prompts[:4], 1), 4, 4))  # warm-up
        c16 = asyncio.run(run_phase(base_url, salted(prompts, 2), args.output_len, args.concurrency))
        burst = asyncio.run(run_phase(base_url, prompts, args.output_len, len(prompts)))
    finally:
        if process is not None:
            process.terminate()
            process.wait(60)
    offline_cmd = [sys.executable, __file__, "--offline-only", "--num-prompts", str(args.num_prompts),
                   "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)]
    offline = json.loads(subprocess.run(offline_cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])

    ratio = burst["output_tps"] / offline["output_tps"]
    print(f"\nW3: {args.num_prompts} requests, {args.prompt_len}-token prompts, {args.output_len} output tokens")
    print(f"{'phase':<22}{'out tok/s':>10}{'TTFT med':>10}{'TTFT p99':>10}{'ITL med':>10}{'ITL p99':>10}")
    for name, r in [(f"server c={args.concurrency}", c16), ("server all at once", burst)]:
        print(f"{name:<22}{r['output_tps']:>10.1f}{r['ttft_median_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s"
              f"{r['itl_median_s'] * 1000:>8.0f}ms{r['itl_p99_s'] * 1000:>8.0f}ms")
    print(f"{'offline LLM.generate':<22}{offline['output_tps']:>10.1f}")
    print(f"server all-at-once / offline: {ratio:.3f} (target >= 0.85)\n")
    print(json.dumps({"benchmark": "serve_latency", "c16": c16, "all_at_once": burst, "offline": offline,
                      "server_over_offline": ratio}))


if __name__ == "__main__":
    main()
