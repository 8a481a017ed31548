"""Tensor-parallel workers as Ray actors (`--distributed-executor-backend ray`): rank r of a
replica runs tp_worker's loop in its own bundle of the replicas' placement group, on whichever node
Ray put that bundle; the ranks meet at rank 0's store (rendezvous.host: rank 0's node address)."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from tokenmill.executor.rendezvous import TOKEN_ENV, Rendezvous

logger = logging.getLogger(__name__)

HEALTH_INTERVAL = 0.5  # seconds between two asks whether a worker actor still runs


class TPWorkerActor:
    """One rank > 0 (wrapped by ray.remote in start_ray_workers)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, token: str, num_threads: int) -> None:
        os.environ[TOKEN_ENV] = token
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.code: int | None = None
        args = [host, str(port), str(rank), str(world_size)]
        threading.Thread(target=self._run, args=(args,), name="tokenmill-tp-worker", daemon=True).start()

    def _run(self, args: list[str]) -> None:
        from tokenmill.executor.tp_worker import main

        self.code = main(args)

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def poll(self) -> int | None:
        return self.code


class RayWorkerHandle:
    """What TensorParallelExecutor needs of a worker (subprocess.Popen's poll, wait, kill)."""

    def __init__(self, actor) -> None:
        self.actor = actor
        self._code: int | None = None
        self._asked = 0.0

    def poll(self) -> int | None:
        if self._code is None and time.monotonic() - self._asked >= HEALTH_INTERVAL:
            import ray

            self._asked = time.monotonic()
            try:
                self._code = ray.get(self.actor.poll.remote(), timeout=30)
            except Exception:  # the actor, or its node, is gone
                self._code = -9
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("tp_worker", timeout)
            time.sleep(HEALTH_INTERVAL)
        return code

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)
        self._code = -9


def start_ray_workers(rendezvous: Rendezvous, num_threads: int) -> list[RayWorkerHandle]:
    import ray
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_placement_group(rendezvous.ray_placement_group)
    worker_class = ray.remote(max_concurrency=2)(TPWorkerActor)
    handles = []
    for rank, bundle in enumerate(rendezvous.ray_bundles[1:], start=1):
        actor = worker_class.options(num_cpus=num_threads, scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=bundle)).remote(
            rendezvous.host, rendezvous.port, rank, rendezvous.world_size, rendezvous.token, num_threads)
        node_id, pid = ray.get(actor.where.remote(), timeout=600)
        logger.info("tensor-parallel rank %d: a Ray actor on node %s (pid %d)", rank, node_id[:12], pid)
        handles.append(RayWorkerHandle(actor))
    return handles
