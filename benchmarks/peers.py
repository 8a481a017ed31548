"""tokenmill against the servers a user would pick instead, one after the other, same weights, same client.

  tokenmill   `tokenmill serve` on the default model (the GGUF's own Q4_1 weights)
  llama.cpp   `llama-server` on the same GGUF (build it with ../shared/peers/build_llamacpp.sh)
  vLLM        its CPU build's OpenAI server on an HF bf16 copy of the same weights, where installed

Every server is driven by tokenmill's streaming client (tokenmill/bench) with the same token-id prompts
(windows of benchmarks/data/mills.txt), greedy, ignore_eos, no prefix-cache hits between phases:
  W1  three different 128-token prompts -> 128 tokens, one at a time (TTFT, decode tok/s), twice (the
      second time with another first token, so that no prompt hits a prefix cache); all servers are up
      and take turns prompt by prompt, so that each W1 figure is of the same minutes; the servers not
      being measured are paused (SIGSTOP) in every phase, as vLLM's idle workers spin
  W2  64 x 256 -> 128 all at once (total and output tok/s), one engine at a time
  W3  64 x 256 -> 128 at concurrency 16 (TTFT p99, ITL median), one engine at a time
It also records peak RSS of each server's whole process tree (through W1, and through all phases) and
the seconds from launch to answering /v1/models (servers start one after another). Prints a table
and one JSON line (ratios tokenmill / peer). Not in CI. Usage:
    python benchmarks/peers.py [--llama-server PATH] [--vllm-python PATH --hf-dir DIR] [--skip NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_prompts  # noqa: E402
from serve_latency import salted  # noqa: E402

from tokenmill.bench.serve import BenchRequest, run_load, served_model_name, summarize  # noqa: E402

DEFAULT_LLAMA_SERVER = Path.home() / ".cache/tokenmill-peers/llama.cpp/build/bin/llama-server"


# ---- process trees: memory, pausing ---------------------------------------------------------
def process_tree(root: int) -> dict[int, int]:
    """{pid: resident bytes} of `root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    tree, stack = {}, [root]
    while stack:
        pid = stack.pop()
        tree[pid] = rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return tree


def tree_rss_mb(root: int) -> float:
    """Resident memory of `root` and all its descendants."""
    return sum(process_tree(root).values()) / 2**20


def signal_tree(root: int, sig: signal.Signals) -> None:
    for pid in process_tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class PeakRss(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.done = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            self.peak = max(self.peak, tree_rss_mb(self.pid))


# ---- servers ----------------------------------------------------------------------------------
def wait_ready(port: int, process: subprocess.Popen, log: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:])
            raise SystemExit(f"the server exited with {process.returncode} before it was ready; the end of {log}:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"the server did not become ready (its output: {log})")


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if name in ("tokenmill", "tokenmill-1p"):
        command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--log-level", "warning",
                   *shlex.split(args.tokenmill_args)]
        if name == "tokenmill-1p":  # the engine on the server process's main thread (before issue 15)
            command.append("--no-engine-process")
        from tokenmill.hardware import cached_cpu_peaks

        peaks = cached_cpu_peaks()  # given, so that no background measurement runs while a peer decodes
        if peaks is not None:
            command += ["--peak-tflops", str(peaks.bf16_tflops), "--peak-bandwidth-gbs", str(peaks.bandwidth_gbs)]
        return command, env
    if name == "llama.cpp":
        from tokenmill.models.model_files import default_model_path

        return [str(args.llama_server), "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port),
                "-t", str(os.cpu_count()), "-tb", str(os.cpu_count()), "-np", "16", "-c", "8192", "--no-webui",
                "--log-disable"], env
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}")
    return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.hf_dir),
            "--served-model-name", "default", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048"], env


# ---- workloads --------------------------------------------------------------------------------
def phase(port: int, model: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    requests = [BenchRequest(p, output_len) for p in prompts]
    records, elapsed = asyncio.run(run_load(f"http://127.0.0.1:{port}", model, requests, float("inf"),
                                            concurrency, None, seed=0, extra_body={"cache_prompt": False}))
    report = summarize(records, elapsed, None, None, None)
    if report["failed"]:
        raise SystemExit(f"{report['failed']} requests failed, first: {report['errors'][0]}")
    decode = [(r.output_tokens - 1) / (r.e2e - r.ttft) for r in records if r.output_tokens > 1]
    return {**report, "decode_tps_median": statistics.median(decode)}


class Server:
    """One engine's server: launched, timed to ready, its process tree's RSS sampled until stop()."""

    def __init__(self, name: str, args: argparse.Namespace, port: int) -> None:
        self.name, self.port = name, port
        command, env = server_command(name, args, port)
        self.log = Path(tempfile.gettempdir()) / f"peers-{name}.log"  # its output, for when it fails to start
        launched = time.perf_counter()
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.sampler = PeakRss(self.process.pid)
        self.sampler.start()
        try:
            wait_ready(port, self.process, self.log)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - launched
        self.model = served_model_name(f"http://127.0.0.1:{port}", None, None)

    def run(self, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        return phase(self.port, self.model, prompts, output_len, concurrency)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue its whole process tree: an idle server is not always idle
        (vLLM's CPU worker threads spin: up beside the others, it cost their W1 15-25%)."""
        signal_tree(self.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        self.pause(False)
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.sampler.done.set()


def run_engines(names: list[str], args: argparse.Namespace, prompts: dict[str, list[list[int]]]) -> list[dict]:
    """Every server up at once (launched one after another, each timed alone, the others paused);
    W1 with the engines taking turns prompt by prompt, so that they decode in the same minutes
    (this machine's speed drifts by up to 2x within an hour); W2 and W3 one engine at a time. The
    servers not being measured are paused (SIGSTOP), so that none takes CPU from another."""
    servers: list[Server] = []

    def measure(server: Server, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
        for other in servers:
            other.pause(other is not server)
        return server.run(prompts, output_len, concurrency)

    try:
        for i, name in enumerate(names):
            for other in servers:
                other.pause(True)
            servers.append(Server(name, args, args.port + i))
            measure(servers[-1], prompts["warmup"], 8, 4)
        w1: dict[str, list[dict]] = {s.name: [] for s in servers}
        for prompt in prompts["w1"]:
            for server in servers:
                w1[server.name].append(measure(server, [prompt], args.output_len, 1))
        results = []
        for server in servers:
            result = {
                "engine": server.name, "ready_s": server.ready_s, "peak_rss_w1_mb": server.sampler.peak,
                "w1_ttft_ms": statistics.median(r["ttft_ms"]["median"] for r in w1[server.name]),
                "w1_decode_tps": statistics.median(r["decode_tps_median"] for r in w1[server.name]),
                "w2_total_tps": None, "w2_output_tps": None, "w3_ttft_p99_ms": None, "w3_itl_median_ms": None,
            }
            if not args.w1_only:
                w2 = measure(server, prompts["w2"], args.output_len, len(prompts["w2"]))
                w3 = measure(server, prompts["w3"], args.output_len, args.concurrency)
                result.update(w2_total_tps=w2["total_token_throughput"], w2_output_tps=w2["output_throughput"],
                              w3_ttft_p99_ms=w3["ttft_ms"]["p99"], w3_itl_median_ms=w3["itl_ms"]["median"])
            # read after its last phase (until 2026-12-06 it was read before W2: start-up and W1 only)
            result["peak_rss_mb"] = server.sampler.peak
            results.append(result)
        return results
    finally:
        for server in servers:
            server.stop()


def matmul_peak_tops(dtype: str, size: int = 2048, runs: int = 3) -> float:
    """A [size, size] x [size, size] product on this CPU, best of `runs`, in tera-ops per second:
    "int8", oneDNN's int8 x int8 -> int32 (torch._int_mm), the peak to hold W2 against where
    tokenmill's batches multiply 8-bit activations with AVX-512 VNNI; "float32", torch.mm, where
    they do it with AVX2 (torch._int_mm has no fast kernel there: ~0.001 TOPS on a Zen 3)."""
    import torch

    if dtype == "int8":
        a = torch.randint(-127, 128, (size, size), dtype=torch.int8)
        b = torch.randint(-127, 128, (size, size), dtype=torch.int8)
        product = torch._int_mm
    else:
        a, b = torch.randn(size, size), torch.randn(size, size)
        product = torch.mm
    best = float("inf")
    for _ in range(runs + 1):  # the first warms oneDNN up
        start = time.perf_counter()
        product(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def roofline(result: dict) -> dict:
    """tokenmill's W1 bytes per second (the weights read per decoded token x tok/s) and W2 FLOP/s
    (2 per weight per token, attention left out), against this machine's measured peaks (bf16,
    and int8 where batches go through quant_gemm_q8)."""
    import numpy as np
    import torch

    from tokenmill.layers.quantized import rounds_rows_to_8_bits
    from tokenmill.platform import cpu_flags, resolve_dtype

    from tokenmill.hardware import cached_cpu_peaks, measure_cpu_peaks
    from tokenmill.models.gguf_loader import GGUFFile
    from tokenmill.models.model_files import default_model_path

    gguf = GGUFFile(default_model_path())
    config = gguf.model_config()
    tensor_bytes = sum(t.data.nbytes for t in gguf.contents.tensors)  # a tied embedding is read whole, as the head
    params = sum(int(np.prod(t.shape)) for t in gguf.contents.tensors)
    lookup_only = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    peaks = cached_cpu_peaks() or measure_cpu_peaks()
    bytes_per_s = tensor_bytes * result["w1_decode_tps"]
    out = {"w1_weight_bytes_per_token_mb": tensor_bytes / 1e6, "w1_achieved_gbs": bytes_per_s / 1e9}
    if peaks is not None:
        out.update(bandwidth_gbs=peaks.bandwidth_gbs, bf16_tflops=peaks.bf16_tflops,
                   w1_fraction_of_bandwidth=bytes_per_s / 1e9 / peaks.bandwidth_gbs)
    if result["w2_total_tps"] is None:  # --w1-only
        return out
    flops = 2 * (params - lookup_only) * result["w2_total_tps"]
    out["w2_achieved_tflops"] = flops / 1e12
    if peaks is not None:
        out["w2_fraction_of_matmul_peak"] = flops / 1e12 / peaks.bf16_tflops
    cpu = torch.device("cpu")
    if rounds_rows_to_8_bits(cpu, resolve_dtype("auto", cpu), dtype_was_auto=True):  # what `serve` chose
        if "avx512_vnni" in cpu_flags():
            out["int8_tops"] = matmul_peak_tops("int8")
            out["w2_fraction_of_int8_peak"] = flops / 1e12 / out["int8_tops"]
        else:  # AVX2: the model runs in float32, its batches through our own integer kernel
            out["float32_tflops"] = matmul_peak_tops("float32")
            out["w2_fraction_of_float32_peak"] = flops / 1e12 / out["float32_tflops"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, default=Path(os.environ.get("LLAMA_SERVER", DEFAULT_LLAMA_SERVER)))
    parser.add_argument("--vllm-python", type=Path, default=None, help="python of a venv with vllm-cpu installed")
    parser.add_argument("--hf-dir", type=Path, default=None, help="an HF bf16 copy of the default model, for vLLM")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tokenmill", "llama.cpp", "vllm"])
    parser.add_argument("--port", type=int, default=8790)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--w1-rounds", type=int, default=2,
                        help="times each engine decodes each W1 prompt (with another first token each time)")
    parser.add_argument("--quick", action="store_true", help="16 prompts x 32 tokens, a smoke run")
    parser.add_argument("--w1-only", action="store_true", help="W1 only (no W2, W3)")
    parser.add_argument("--tokenmill-args", default="",
                        help='more arguments for tokenmill serve, e.g. "--dtype float32"; run the script with '
                             "ATEN_CPU_CAPABILITY=avx2 and a llama-server built for AVX2 only to compare as on an "
                             "AVX2 CPU")
    parser.add_argument("--in-process-too", action="store_true",
                        help="also run tokenmill-1p: tokenmill serve --no-engine-process (one process)")
    parser.add_argument("--in-process-first", action="store_true", help="with --in-process-too: run it first")
    args = parser.parse_args()

    from tokenmill.models.model_files import default_model_path, load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    num = 16 if args.quick else 64
    if args.quick:
        args.output_len = 32
    long_prompts = build_prompts(tokenizer, num + 3, 256)
    w1 = [p[:128] for r in range(args.w1_rounds) for p in salted(long_prompts[-3:], 20 + r)]
    prompts = {"warmup": salted(long_prompts[:4], 11), "w1": w1,
               "w2": salted(long_prompts[:num], 13), "w3": salted(long_prompts[:num], 14)}
    engines = ["tokenmill"] + (["tokenmill-1p"] if args.in_process_too else [])
    if args.in_process_first:
        engines.reverse()
    if args.llama_server.is_file():
        engines.append("llama.cpp")
    else:
        print(f"llama.cpp: no {args.llama_server} (../shared/peers/build_llamacpp.sh builds it)", file=sys.stderr)
    if args.vllm_python is not None and args.hf_dir is not None:
        engines.append("vllm")
    if "tokenmill" not in args.skip:
        # the target is ready in 5 s "when kernels are already built": build them here (a cache the
        # server then loads), or a changed kernel source is compiled inside the server's start-up
        # and the compiler counts in its time and peak RSS
        from tokenmill.layers.cpu_kernels import load_avx2_kernels, load_cpu_kernels

        load_cpu_kernels()
        load_avx2_kernels()
    results = run_engines([name for name in engines if name not in args.skip], args, prompts)

    columns = [("ready_s", "ready s", ".1f"), ("peak_rss_w1_mb", "RSS W1 MB", ".0f"), ("peak_rss_mb", "RSS MB", ".0f"),
               ("w1_ttft_ms", "W1 TTFT ms", ".0f"),
               ("w1_decode_tps", "W1 tok/s", ".1f"), ("w2_total_tps", "W2 total", ".0f"),
               ("w2_output_tps", "W2 out", ".0f"), ("w3_ttft_p99_ms", "W3 TTFT p99", ".0f"),
               ("w3_itl_median_ms", "W3 ITL ms", ".1f")]
    print(f"\n{'engine':<11}" + "".join(f"{title:>13}" for _, title, _ in columns))
    for r in results:
        print(f"{r['engine']:<11}" + "".join(f"{r[key]:>13{fmt}}" if r[key] is not None else f"{'-':>13}"
                                             for key, _, fmt in columns))
    ours = next((r for r in results if r["engine"] == "tokenmill"), None)
    ratios = {}
    if ours is not None:
        for peer in (r for r in results if r is not ours):
            for key, _, _ in columns:
                ratios[f"{key}_tokenmill_over_{peer['engine']}"] = ours[key] / peer[key] if peer[key] and ours[key] \
                    else None
        line = roofline(ours)
        print(f"\ntokenmill W1: {line['w1_weight_bytes_per_token_mb']:.0f} MB of weights per token, "
              f"{line['w1_achieved_gbs']:.1f} GB/s" + (f" of {line['bandwidth_gbs']:.1f} measured" if "bandwidth_gbs" in line
                                                      else "")
              + (f"; W2: {line['w2_achieved_tflops']:.3f} TFLOP/s" if "w2_achieved_tflops" in line else "")
              + (f" of {line['bf16_tflops']:.2f} bf16 peak" if "w2_achieved_tflops" in line and "bf16_tflops" in line
                 else "")
              + (f" and {line['int8_tops']:.2f} int8 (batches multiply 8-bit activations)" if "int8_tops" in line else "")
              + (f" and {line['float32_tflops']:.2f} float32 (the model's dtype here)" if "float32_tflops" in line
                 else ""))
        ratios["tokenmill_roofline"] = line
    print(json.dumps({"benchmark": "peers", "results": results, "ratios": ratios}))


if __name__ == "__main__":
    main()
