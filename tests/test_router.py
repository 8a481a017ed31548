"""tokenmill behind an existing router: vLLM's Rust router (PyPI `vllm-router`) in front of two
`tokenmill serve` instances, driven with the official openai client. Its cache-aware policy sends
requests that share a prompt prefix to the same instance, so more of their prompts are served
from the prefix cache than under round-robin."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import free_port, start_server, wait_until

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
if not Path(ROUTER).exists():
    pytest.skip("vllm-router is not installed (pip install -e '.[test]' installs it)", allow_module_level=True)

TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "glass", "clocks"]


def _system_prompt(topic: str) -> str:
    facts = " ".join(f"Fact {i} about {topic}: {topic} have property number {i * 7 + 3}." for i in range(24))
    return f"You are an expert on {topic}. {facts} Answer briefly."


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, tmp_path_factory):
    started = [start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--served-model-name", "tiny"],
                            tmp_path_factory.mktemp(f"worker{i}")) for i in range(2)]
    yield started
    for worker in started:
        assert worker.stop() == 0, worker.log()


def _start_router(workers, policy: str, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_dir / f"router-{policy}.log", "wb")
    process = subprocess.Popen(
        [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
         "--worker-urls", *[w.base_url for w in workers], "--worker-startup-check-interval", "1",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=10)

    def ready() -> bool:
        try:
            return client.models.list().data[0].id == "tiny"
        except Exception:
            return False

    assert wait_until(ready, timeout=60, interval=0.5), (log_dir / f"router-{policy}.log").read_text()
    return process, base_url


def _prefix_cache_counts(workers) -> tuple[float, float]:
    hits = sum(w.metric("tokenmill:prefix_cache_hits_total") for w in workers)
    queries = sum(w.metric("tokenmill:prefix_cache_queries_total") for w in workers)
    return hits, queries


def _hit_rate_through(workers, policy: str, topics: list[str], log_dir: Path) -> float:
    """Six chats for each topic through a router with `policy`; the prefix-cache hit rate they got."""
    process, base_url = _start_router(workers, policy, log_dir)
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        hits_before, queries_before = _prefix_cache_counts(workers)
        for round_ in range(6):
            for topic in topics:
                reply = client.chat.completions.create(
                    model="tiny", max_tokens=4, temperature=0,
                    messages=[{"role": "system", "content": _system_prompt(topic)},
                              {"role": "user", "content": f"Question {round_} about {topic}?"}])
                assert reply.choices[0].finish_reason in ("stop", "length")
                assert reply.usage.completion_tokens >= 1
        hits, queries = _prefix_cache_counts(workers)
    finally:
        process.terminate()
        process.wait(30)
    return (hits - hits_before) / (queries - queries_before)


def test_cache_aware_router_keeps_prefixes_together(workers, tmp_path):
    # three prefixes taken in turn: round-robin over two instances sends each to both
    cache_aware = _hit_rate_through(workers, "cache_aware", TOPICS[:3], tmp_path)
    round_robin = _hit_rate_through(workers, "round_robin", TOPICS[3:6], tmp_path)
    # six requests per prefix: one miss per prefix on one instance vs one on each of the two
    assert cache_aware > 0.75, (cache_aware, round_robin)
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)
    for worker in workers:  # both instances served, and nothing holds KV blocks afterwards
        assert worker.metric("tokenmill:request_success_total") > 0
        assert worker.metric("tokenmill:kv_cache_usage_perc") == 0.0
        log = worker.log()
        assert "POST /v1/chat/completions/render 200" in log  # the router places requests by our render
        assert " 404 " not in log and " 500 " not in log
