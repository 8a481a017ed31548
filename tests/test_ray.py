"""Replicas on a Ray cluster (`--distributed-executor-backend ray`): a simulated two-node cluster
(ray.cluster_utils.Cluster, one CPU per node) with a replica on each node, serving the same tokens
as a local engine; the replica on the second node serves requests, and its death is survived."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import start_server, wait_until

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")  # installed by the test extras

pytestmark = pytest.mark.slow
PROMPTS = ["The mill turns", "Water runs under the", "Grain becomes flour when", "A paged cache holds"]


@pytest.fixture(scope="module")
def cluster():
    cluster = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    yield cluster, second
    cluster.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tmp_path_factory) -> list[str]:
    """What a local engine answers to PROMPTS."""
    local = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path_factory.mktemp("local"))
    try:
        return [_complete(local, p) for p in PROMPTS]
    finally:
        assert local.stop() == 0


def _complete(server, prompt: str) -> str:
    response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True})
    assert response.status == 200, response.body
    return response.json()["choices"][0]["text"]


def test_a_replica_on_the_second_node_serves(cluster, expected, tiny_llama_dir, tmp_path, monkeypatch):
    ray_cluster, second = cluster
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--data-parallel-size", "2",
                           "--distributed-executor-backend", "ray"], tmp_path, timeout=300)
    try:
        replicas = server.request("GET", "/v1/replicas").json()["data"]
        nodes = [r["node"] for r in replicas]
        assert sorted(nodes) == sorted([second.node_id, ray_cluster.head_node.node_id])  # one on each node
        with ThreadPoolExecutor(4) as pool:  # at once: both replicas take some
            assert list(pool.map(lambda p: _complete(server, p), PROMPTS)) == expected
        on_second = next(r for r in server.request("GET", "/v1/replicas").json()["data"] if r["node"] == second.node_id)
        assert on_second["up"] and on_second["prefix_cache_queries"] > 0  # it served prompts
        os.kill(on_second["pid"], signal.SIGKILL)  # the actor on the second node dies (same machine here)
        assert wait_until(lambda: not next(r for r in server.request("GET", "/v1/replicas").json()["data"]
                                           if r["replica"] == on_second["replica"])["up"], 30)
        assert server.request("GET", "/health").status == 200
        assert [_complete(server, p) for p in PROMPTS] == expected  # the other replica serves them all
    finally:
        assert server.stop() == 0
    assert "a Ray actor on node" in server.log()


def test_tensor_parallel_ranks_on_two_nodes(cluster, expected, tiny_llama_dir, tmp_path, monkeypatch):
    ray_cluster, second = cluster
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--tensor-parallel-size", "2",
                           "--distributed-executor-backend", "ray"], tmp_path, timeout=300)
    try:
        assert [_complete(server, p) for p in PROMPTS] == expected
    finally:
        assert server.stop() == 0
    log = server.log()
    # rank 0 (the engine) and rank 1 on different nodes: the bundles are spread
    engine_node = log.split("replica 0: a Ray actor on node ")[1][:12]
    worker_node = log.split("tensor-parallel rank 1: a Ray actor on node ")[1][:12]
    assert {engine_node, worker_node} == {second.node_id[:12], ray_cluster.head_node.node_id[:12]}
