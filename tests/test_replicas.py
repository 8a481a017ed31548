"""Data-parallel replicas (`tokenmill serve --data-parallel-size N`): the router's choices, the
replicas' figures summed, and real servers: same tokens as one engine, prefixes kept together,
a replica's death survived."""

from __future__ import annotations

import random
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_harness import child_pids, read_event, start_server, wait_until

from tokenmill.engine.engine_info import EngineStats, combine_stats
from tokenmill.engine.kv_cache_manager import KVCacheStats, hash_block
from tokenmill.engine.metrics import StepStats
from tokenmill.engine.replica_router import PrefixRouter
from tokenmill.engine.replica_set import replica_gpus, split_cpus

KEY = b"k" * 16


def _prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_router_sends_a_prompt_where_its_longest_prefix_is():
    router = PrefixRouter([100, 100], block_size=4, hash_key=KEY)
    index, hashes = router.choose(_prompt(10))
    assert index == 0 and len(hashes) == 2  # two full blocks; ties go to the lower index
    router.sent(0, hashes, 10)
    # a prompt sharing the first block goes to replica 0 although replica 1 is idle
    shared = _prompt(4) + _prompt(8, 100)
    assert router.choose(shared)[0] == 0
    assert router.cached_blocks(0, router.block_hashes(shared)) == 1
    # a miss goes to the least loaded replica
    other, other_hashes = router.choose(_prompt(8, 500))
    assert other == 1
    router.sent(1, other_hashes, 50)
    assert router.choose(_prompt(8, 900))[0] == 0
    router.done(1, 50)
    router.done(0, 10)
    assert [slot.load_tokens for slot in router.replicas] == [0, 0]


def test_router_hashes_blocks_as_the_engines_do():
    router = PrefixRouter([10], block_size=4, hash_key=KEY)
    first = hash_block(KEY, None, (0, 1, 2, 3))
    assert router.block_hashes(_prompt(9)) == [first, hash_block(KEY, first, (4, 5, 6, 7))]


def test_router_skips_replicas_that_are_down_and_forgets_what_they_held():
    router = PrefixRouter([100, 100], block_size=4, hash_key=KEY)
    index, hashes = router.choose(_prompt(8))
    router.sent(index, hashes, 8)
    router.set_up(0, False)
    assert router.choose(_prompt(8))[0] == 1
    router.set_up(1, False)
    assert router.choose(_prompt(8)) is None
    router.set_up(0, True)  # restarted: an empty cache
    assert router.cached_blocks(0, hashes) == 0


def test_router_remembers_only_as_many_blocks_as_a_replica_holds():
    router = PrefixRouter([2, 2], block_size=4, hash_key=KEY)
    old = router.block_hashes(_prompt(8))
    router.sent(0, old, 8)
    router.sent(0, router.block_hashes(_prompt(8, 50)), 8)  # evicts the older prompt's blocks
    assert router.cached_blocks(0, old) == 0


def test_round_robin_takes_the_next_replica_that_is_up():
    router = PrefixRouter([10, 10, 10], block_size=4, hash_key=KEY, policy="round_robin")
    assert [router.choose(_prompt(8))[0] for _ in range(4)] == [0, 1, 2, 0]
    router.set_up(1, False)
    assert [router.choose(_prompt(8))[0] for _ in range(3)] == [2, 0, 2]


def test_cpus_are_split_in_equal_contiguous_shares():
    assert split_cpus(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]
    assert split_cpus(1, [3, 5]) == [[3, 5]]
    with pytest.raises(ValueError, match="at least 3 CPUs"):
        split_cpus(3, [0, 1])


def test_replicas_take_a_gpu_each_on_cuda_and_none_on_the_cpu():
    assert replica_gpus(2, "auto", 0) == [None, None]
    assert replica_gpus(2, "cpu", 4) == [None, None]
    assert replica_gpus(2, "auto", 4) == [0, 1]
    assert replica_gpus(3, "cuda", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="need 2 GPUs; 1 are visible"):
        replica_gpus(2, "cuda", 1)


def _stats(running: int, used: int, hits: int, steps: int) -> EngineStats:
    kv = KVCacheStats(10, used, 10 - used, used / 10, used * 16, used * 8, 0.5 if used else 0.0, 100, hits)
    return EngineStats(running, 1, 2, kv, num_steps=steps, last_step=StepStats(float(steps), 0.1, 1, 1, 1, 1, 1))


def test_combined_stats_sum_what_is_used_over_live_replicas_and_counts_over_all():
    combined = combine_stats([_stats(3, 4, 30, 7), _stats(5, 6, 40, 9)], [True, False])
    assert (combined.num_running, combined.num_waiting, combined.kv_cache.num_used_blocks) == (3, 1, 4)
    assert combined.kv_cache.num_blocks == 10 and combined.kv_cache.usage == 0.4
    # counters never go back when a replica goes down
    assert (combined.kv_cache.prefix_cache_hits, combined.num_preemptions, combined.num_steps) == (70, 4, 16)
    assert combined.last_step.start_time == 9.0


# ---- real servers -------------------------------------------------------------------------------
SYSTEM_TOPICS = ["lighthouses", "bread", "volcanoes", "chess", "rivers", "bees", "glass", "clocks"]


def _system_prompt(topic: str) -> str:
    facts = " ".join(f"Fact {i} about {topic}: {topic} have property number {i * 7 + 3}." for i in range(20))
    return f"You are an expert on {topic}. {facts} Answer briefly."


def _allowed_cpus(pid: int) -> list[int]:
    """The CPUs a process may run on, from /proc (e.g. "0-2,5" -> [0, 1, 2, 5])."""
    text = Path(f"/proc/{pid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
    cpus = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def _complete(server, prompt: str, max_tokens: int = 12) -> str:
    response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                               "ignore_eos": True})
    assert response.status == 200, response.body
    return response.json()["choices"][0]["text"]


def _replicas(server) -> list[dict]:
    return server.request("GET", "/v1/stats").json()["engine"]["replicas"]


def _serve(model_dir, log_dir, *extra: str):
    return start_server(["--model", str(model_dir), "--dtype", "float32", *extra], log_dir)


@pytest.fixture(scope="module")
def single(tiny_llama_dir, tmp_path_factory):
    server = _serve(tiny_llama_dir, tmp_path_factory.mktemp("dp1"))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    server = _serve(tiny_llama_dir, tmp_path_factory.mktemp("dp2"), "--data-parallel-size", "2")
    yield server
    assert server.stop() == 0


@pytest.mark.slow
def test_two_replicas_give_one_engines_tokens_each_on_its_own_cpu(single, pair):
    prompts = ["The mill turns", "Water runs under the", "Grain becomes flour when", "A paged cache holds"]
    with ThreadPoolExecutor(4) as pool:  # at once, so that both replicas serve some of them
        together = list(pool.map(lambda p: _complete(pair, p), prompts))
    assert together == [_complete(single, p) for p in prompts]
    replicas = _replicas(pair)
    assert [r["up"] for r in replicas] == [True, True]
    assert [r["cpu_cores"] for r in replicas] == split_cpus(2)
    assert [_allowed_cpus(r["pid"]) for r in replicas] == split_cpus(2)
    assert sorted(r["pid"] for r in replicas) == child_pids(pair.process.pid)
    assert pair.metric("tokenmill:replica_up", replica="0") == 1.0
    assert pair.metric("tokenmill:replica_up", replica="1") == 1.0


def _hit_rate(server, order: list[tuple[str, int]]) -> float:
    hits = server.metric("tokenmill:prefix_cache_hits_total")
    queries = server.metric("tokenmill:prefix_cache_queries_total")
    with ThreadPoolExecutor(4) as pool:  # four at a time: a router that only balanced load would split prefixes
        list(pool.map(lambda item: _complete(server, f"{_system_prompt(item[0])} Question {item[1]} about {item[0]}?",
                                             max_tokens=2), order))
    return ((server.metric("tokenmill:prefix_cache_hits_total") - hits)
            / (server.metric("tokenmill:prefix_cache_queries_total") - queries))


@pytest.mark.slow
def test_cache_aware_routing_keeps_each_prefix_on_one_replica(single, pair, tiny_llama_dir, tmp_path):
    # 8 system prompts x 8 requests in a shuffled order; each server sees other questions (no
    # whole-prompt hits) and prompts it has not seen before
    orders = []
    for seed in range(3):
        order = [(topic, 100 * seed + q) for topic in SYSTEM_TOPICS for q in range(8)]
        random.Random(seed).shuffle(order)
        orders.append([(f"{topic} {seed}", q) for topic, q in order])
    one_replica = _hit_rate(single, orders[0])
    before = [r["prefix_cache_queries"] for r in _replicas(pair)]
    cache_aware = _hit_rate(pair, orders[1])
    assert all(r["prefix_cache_queries"] > b for r, b in zip(_replicas(pair), before))  # both replicas served
    round_robin_server = _serve(tiny_llama_dir, tmp_path, "--data-parallel-size", "2", "--routing", "round_robin")
    try:
        round_robin = _hit_rate(round_robin_server, orders[2])
    finally:
        assert round_robin_server.stop() == 0
    assert cache_aware >= 0.9 * one_replica, (one_replica, cache_aware, round_robin)
    assert cache_aware > round_robin + 0.05, (one_replica, cache_aware, round_robin)


@pytest.mark.slow
def test_a_dead_replica_fails_only_its_requests_and_the_rest_goes_on(tiny_llama_dir, tmp_path):
    server = _serve(tiny_llama_dir, tmp_path, "--data-parallel-size", "2")
    try:
        streams = [server.open_stream("/v1/completions", {"prompt": f"stream {i} runs", "max_tokens": 400,
                                                          "ignore_eos": True}) for i in range(6)]
        for _, response in streams:
            assert read_event(response)["choices"]
        replicas = _replicas(server)
        assert all(r["requests_in_flight"] > 0 for r in replicas)  # the load went to both
        victim = replicas[1]
        os.kill(victim["pid"], signal.SIGKILL)
        endings = []
        for conn, response in streams:
            events = []
            while (event := read_event(response)) not in (None, "[DONE]"):
                events.append(event)
            conn.close()
            endings.append(events[-1].get("error", {}).get("type") or events[-1]["choices"][0]["finish_reason"])
        assert endings.count("engine_dead") == victim["requests_in_flight"]
        assert endings.count("length") == 6 - victim["requests_in_flight"]
        assert server.request("GET", "/health").status == 200
        assert _complete(server, "still serving?")  # new requests go to the replica that is left
        after = _replicas(server)
        assert [r["up"] for r in after] == [True, False]
        assert server.metric("tokenmill:replica_up", replica="1") == 0.0
        assert wait_until(lambda: _replicas(server)[0]["kv_cache"]["num_used_blocks"] == 0, 10)
        assert "replica 1 is down" in server.log()
        # up again without restarting the server: a new engine process, serving its share
        conflict = server.post("/v1/replicas/0/restart", None)
        assert conflict.status == 400 and "replica 0 is up" in conflict.json()["error"]["message"]
        assert server.post("/v1/replicas/7/restart", None).status == 404
        restarted = server.post("/v1/replicas/1/restart", None)
        assert restarted.status == 200, restarted.body
        new_pid = restarted.json()["pid"]
        assert new_pid != victim["pid"] and new_pid in child_pids(server.process.pid)
        assert wait_until(lambda: [r["up"] for r in server.request("GET", "/v1/replicas").json()["data"]]
                          == [True, True], 10)
        before = server.request("GET", "/v1/replicas").json()["data"][1]["prefix_cache_queries"]
        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(lambda i: _complete(server, f"after the restart {i}"), range(8)))
        assert server.request("GET", "/v1/replicas").json()["data"][1]["prefix_cache_queries"] > before
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log()  # e.g. a counter that went back when the new replica started at 0
