"""Soak: minutes of open-loop mixed load on `tokenmill serve` at twice its measured capacity, with a
KV budget small enough to force preemption, then SIGTERM under load.

The mix: completions and chat, streamed (70%) and not, random prompt and output lengths, n = 2 for
a fifth of the requests, seeded sampling, and 10% of streamed clients hanging up mid-stream.
Capacity is measured first (closed loop, 8 clients, 30 s); the open loop then sends Poisson arrivals
at twice that rate. Reports requests sent / completed / aborted by disconnect / rejected (503) /
failed, the 5xx count (target 0), KV blocks in use after the drain (target 0: cached prefixes sit in
free blocks), the server's RSS over time (target: flat after warm-up) and the drain's exit status.

    python benchmarks/soak.py [--minutes 10] [--model PATH] [--kv-cache-memory BYTES] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORDS = ("mill wheel water grain flour stone river miller sack bread wind sail gear shaft "
         "hopper meal barley wheat rye oats race dam pond sluice").split()


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    rejected: int = 0  # 503
    client_errors: int = 0  # other 4xx
    server_errors: int = 0  # 5xx, or a 5xx error event in a stream (other than the drain's 503)
    aborted_by_drain: int = 0  # in flight when the drain timeout ran out: a 503 error event
    transport_errors: int = 0  # refused / reset connections (after SIGTERM the listener closes)
    statuses: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fetch_json(port: int, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return json.load(response)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def make_request(rng: random.Random) -> tuple[str, dict, bool, int | None]:
    """(path, body, streamed, disconnect after this many events or None)."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 240)))
    body = {"max_tokens": rng.randint(16, 200), "temperature": 0.8, "seed": rng.randrange(1 << 31),
            "n": 2 if rng.random() < 0.2 else 1, "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", words
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    streamed = rng.random() < 0.7
    hang_up = rng.randint(1, 4) if streamed and rng.random() < 0.1 else None
    return path, body, streamed, hang_up


async def send(port: int, path: str, body: dict, streamed: bool, hang_up: int | None, tally: Tally) -> None:
    tally.sent += 1
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        tally.transport_errors += 1
        return
    try:
        payload = json.dumps({**body, "stream": streamed}).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        tally.statuses[status] = tally.statuses.get(status, 0) + 1
        rest = b""
        if status == 200 and hang_up is not None:
            events = 0
            while events < hang_up and (line := await reader.readline()):
                events += line.startswith(b"data: ")
            tally.disconnected += 1
            return  # hang up mid-stream
        rest = await asyncio.wait_for(reader.read(), 900)
        if status == 200 and b'data: {"error"' in rest:  # the event that ends a failed stream
            if b'"code":503' in rest:
                tally.aborted_by_drain += 1
            else:
                tally.server_errors += 1
                tally.errors.append(rest[rest.find(b'data: {"error"'):][:200].decode(errors="replace"))
        elif status == 200:
            tally.completed += 1
        elif status == 503:
            tally.rejected += 1
        elif status >= 500:
            tally.server_errors += 1
            tally.errors.append(rest[-300:].decode(errors="replace"))
        else:
            tally.client_errors += 1
            tally.errors.append(rest[-300:].decode(errors="replace"))
    except (OSError, IndexError, ValueError, asyncio.TimeoutError) as exc:
        tally.transport_errors += 1
        tally.errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        writer.close()


async def closed_loop(port: int, seconds: float, clients: int, rng: random.Random) -> float:
    """Completed requests per second with `clients` always busy."""
    tally, deadline = Tally(), time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < deadline:
            path, body, _, _ = make_request(rng)
            await send(port, path, body, False, None, tally)

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(clients)])
    return tally.completed / (time.perf_counter() - start)


async def open_loop(port: int, seconds: float, rate: float, rng: random.Random, tally: Tally,
                    on_tick=None) -> list[asyncio.Task]:
    tasks, deadline = [], time.perf_counter() + seconds
    next_tick = time.perf_counter()
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(send(port, *make_request(rng), tally)))
        await asyncio.sleep(rng.expovariate(rate))
        if on_tick is not None and time.perf_counter() >= next_tick:
            on_tick()
            next_tick += 5.0
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=30 * 2**20, help="bytes (default 30 MiB)")
    parser.add_argument("--calibrate-seconds", type=float, default=30.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    port = free_port()
    log_path = Path(tempfile.mkdtemp()) / "server.log"
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
               "--kv-cache-memory", str(args.kv_cache_memory), "--max-queued-requests", "64"]
    if args.model:
        command += ["--model", args.model]
    server = subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    rng = random.Random(0)
    rss = [(0.0, rss_mb(server.pid))]
    start = time.perf_counter()

    async def run() -> tuple[float, Tally, int | None, float]:
        capacity = await closed_loop(port, args.calibrate_seconds, 8, rng)
        rate = max(0.1, 2 * capacity)
        rss.append((time.perf_counter() - start, rss_mb(server.pid)))
        tally = Tally()
        tasks = await open_loop(port, args.minutes * 60, rate, rng, tally,
                                on_tick=lambda: rss.append((time.perf_counter() - start, rss_mb(server.pid))))
        stats = await asyncio.to_thread(fetch_json, port, "/v1/stats")
        server.send_signal(signal.SIGTERM)  # under load: keep sending while it drains
        sigterm_at = time.perf_counter()
        tasks += await open_loop(port, 5.0, rate, rng, tally)
        await asyncio.gather(*tasks)
        exit_status = await asyncio.to_thread(server.wait, 300)
        return rate, tally, exit_status, time.perf_counter() - sigterm_at, stats

    rate, tally, exit_status, drain_seconds, stats = asyncio.run(run())
    log = log_path.read_text(errors="replace")
    match = re.search(r"KV blocks in use: (\d+) of (\d+)", log)
    preemptions = stats.get("engine", {}).get("num_preemptions")
    warm = [mb for t, mb in rss if t >= args.calibrate_seconds + 60] or [rss[-1][1]]
    result = {
        "benchmark": "soak", "minutes": args.minutes, "request_rate": round(rate, 3),
        "sent": tally.sent, "completed": tally.completed, "aborted_by_disconnect": tally.disconnected,
        "rejected_503": tally.rejected, "aborted_by_drain_timeout": tally.aborted_by_drain,
        "client_errors_4xx": tally.client_errors,
        "server_errors_5xx": tally.server_errors, "transport_errors": tally.transport_errors,
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "kv_blocks_in_use_after_drain": int(match.group(1)) if match else None,
        "rss_mb_start": round(rss[0][1]), "rss_mb_after_warmup": round(warm[0]), "rss_mb_end": round(rss[-1][1]),
        "rss_mb_max": round(max(mb for _, mb in rss)), "drain_exit_status": exit_status,
        "drain_seconds": round(drain_seconds, 1), "preemptions": preemptions,
        "tracebacks_in_log": log.count("Traceback"), "first_errors": tally.errors[:5],
        "rss_mb_series": [[round(t), round(mb)] for t, mb in rss],
    }
    print(f"{'requests sent':<32}{tally.sent:>10}")
    for key in ("completed", "aborted_by_disconnect", "rejected_503", "aborted_by_drain_timeout", "client_errors_4xx",
                "server_errors_5xx",
                "transport_errors", "kv_blocks_in_use_after_drain", "rss_mb_start", "rss_mb_after_warmup",
                "rss_mb_end", "drain_exit_status", "drain_seconds", "preemptions"):
        print(f"{key:<32}{result[key]!s:>10}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
