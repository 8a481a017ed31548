"""ReplicaSet: N engine processes behind one server (data parallelism), as one AsyncLLMEngine core.

Each request goes to the replica PrefixRouter picks (longest cached prefix, else least loaded)
and stays there; aborts follow it. One thread (run) follows every replica's results with one
zmq poller and publishes each step's outputs with the figures of all replicas summed. A replica
that dies is marked down: its in-flight requests fail with EngineDeadError, new requests go to
the others, and only when none is left does the server end (fatal, as with one engine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from tokenmill.engine.engine_client import POLL_MS, RUNNING, EngineProcessClient, RemoteEngine
from tokenmill.engine.engine_info import EngineStats, combine_stats
from tokenmill.engine.engine_loop import Command, StepResult
from tokenmill.engine.replica_router import PrefixRouter
from tokenmill.errors import EngineDeadError, InvalidParameterError, ModelNotFoundError

logger = logging.getLogger(__name__)


@dataclass
class ReplicaStatus:
    """One replica as /v1/stats and /metrics show it."""

    index: int
    up: bool
    pid: int
    cpu_cores: list[int] | None
    requests_in_flight: int
    stats: EngineStats
    node: str | None = None  # the Ray node it runs on (--distributed-executor-backend ray)


@dataclass
class _Replica:
    index: int
    client: EngineProcessClient
    up: bool = True
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> tokens charged to its load


class CombinedEngine(RemoteEngine):
    """What the server reads of the replicas together: replica 0's tokenizer, limits and facts
    (every replica loads the same model with the same settings), everyone's figures summed."""

    def __init__(self, replicas: ReplicaSet) -> None:
        first: RemoteEngine = replicas.replicas[0].client.engine
        super().__init__(first.info, first.tokenizer, first.grammars)
        self._replicas = replicas

    def stats(self) -> EngineStats:
        replicas, retired = self._replicas.replicas, self._replicas.retired
        return combine_stats([r.client.engine.stats() for r in replicas] + retired,
                             [r.up for r in replicas] + [False] * len(retired))

    def has_unfinished_requests(self) -> bool:
        return any(r.up and r.client.engine.has_unfinished_requests() for r in self._replicas.replicas)


class ReplicaSet:
    """An AsyncLLMEngine core over ready EngineProcessClients (see launcher.py)."""

    def __init__(self, clients: list[EngineProcessClient], router: PrefixRouter,
                 fork_replica: Callable[[int], EngineProcessClient] | None = None,
                 wait_replica: Callable[[EngineProcessClient], None] | None = None) -> None:
        """fork_replica(index) starts a new engine process for replica `index`, wait_replica(client) waits until it
        has loaded the model: restart() needs both. The fork is done on the run thread, which lives
        as long as the server (PR_SET_PDEATHSIG follows the thread that forked, not the process)."""
        self.replicas = [_Replica(i, client) for i, client in enumerate(clients)]
        self.router = router
        self.fork_replica, self.wait_replica = fork_replica, wait_replica
        self._forks: list[tuple[_Replica, Future]] = []  # restarts waiting for the run thread to fork
        self._restarted: list[tuple[_Replica, EngineProcessClient]] = []  # ready, for the run thread to take in
        self._restarting: set[int] = set()
        self._retired: list[EngineStats] = []  # the last figures of replaced processes: their counts stay
        self._lock = threading.Lock()  # submit() runs on the event loop, run() on its own thread
        self._owner: dict[str, _Replica] = {}
        self._stopping = False
        self.publish = None
        for replica in self.replicas:
            replica.client.publish = lambda result, replica=replica: self._on_step(replica, result)
        self.engine = CombinedEngine(self)

    # ---- the core's interface --------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        if isinstance(command, str):
            with self._lock:
                replica = self._owner.get(command)
            if replica is not None and replica.up:
                replica.client.submit(command)
            return
        tokens = len(command.prompt_token_ids) + (command.params.max_tokens or 0)
        with self._lock:
            chosen = self.router.choose(command.prompt_token_ids)
            if chosen is None:
                raise EngineDeadError("every engine replica is down")
            index, hashes = chosen
            replica = self.replicas[index]
            self.router.sent(index, hashes, tokens * command.params.n)
            replica.in_flight[command.request_id] = tokens * command.params.n
            self._owner[command.request_id] = replica
        replica.client.submit(command)

    def request_stop(self) -> None:
        self._stopping = True
        for replica in self.replicas:
            replica.client.request_stop()

    def run(self) -> EngineDeadError | None:
        poller = zmq.Poller()
        for replica in self.replicas:
            poller.register(replica.client.results_socket, zmq.POLLIN)
        while True:
            self._take_in_restarted(poller)
            ready = dict(poller.poll(POLL_MS))
            for replica in self.replicas:
                if not replica.up:
                    continue
                message = replica.client.receive() if replica.client.results_socket in ready else None
                outcome = replica.client.follow(message)
                if outcome is RUNNING:
                    continue
                replica.up = False
                poller.unregister(replica.client.results_socket)
                if outcome is not None:
                    self._replica_died(replica, outcome)
            if not any(r.up for r in self.replicas):  # stopped as asked, or the last one died
                return None if self._stopping else EngineDeadError("every engine replica is down")

    def restart(self, index: int) -> ReplicaStatus:
        """Start a new engine process for a replica that is down. Blocks until it has loaded the
        model (call it off the event loop); requests go to it once the run thread has taken it in."""
        if self.fork_replica is None or self.wait_replica is None:
            raise InvalidParameterError("this server cannot restart replicas")
        if not 0 <= index < len(self.replicas):
            raise ModelNotFoundError(f"there is no replica {index} (replicas 0..{len(self.replicas) - 1})")
        replica = self.replicas[index]
        forked: Future = Future()
        with self._lock:
            if replica.up or index in self._restarting:
                raise InvalidParameterError(f"replica {index} is {'up' if replica.up else 'restarting'}",
                                            param="index")
            self._restarting.add(index)
            self._forks.append((replica, forked))
        try:
            client = forked.result()
            try:
                self.wait_replica(client)
            except BaseException:
                client.shutdown()
                raise
        except BaseException:
            with self._lock:
                self._restarting.discard(index)
            raise
        client.publish = lambda result: self._on_step(replica, result)
        with self._lock:
            self._restarted.append((replica, client))
        logger.info("replica %d restarted (pid %d)", index, client.process.pid)
        return self._status(replica, client)

    def _take_in_restarted(self, poller: zmq.Poller) -> None:
        """On the run thread: fork what restart() asked for, and serve what has become ready."""
        with self._lock:
            forks, self._forks = self._forks, []
            restarted, self._restarted = self._restarted, []
        for replica, forked in forks:
            try:
                forked.set_result(self.fork_replica(replica.index))
            except Exception as exc:
                forked.set_exception(exc)
        with self._lock:
            for replica, client in restarted:
                old, replica.client = replica.client, client
                self._retired.append(old.engine.stats())
                replica.up = True
                replica.in_flight.clear()
                self.router.set_up(replica.index, True)
                self._restarting.discard(replica.index)
                poller.register(client.results_socket, zmq.POLLIN)
                old.shutdown()  # its process is gone; this closes its sockets

    @property
    def retired(self) -> list[EngineStats]:
        return list(self._retired)

    def statuses(self) -> list[ReplicaStatus]:
        with self._lock:
            return [self._status(r, r.client) for r in self.replicas]

    def _status(self, replica: _Replica, client: EngineProcessClient) -> ReplicaStatus:
        up = replica.up or client is not replica.client  # a restarted client about to be taken in
        return ReplicaStatus(replica.index, up, client.process.pid, client.args.cpu_cores,
                             len(replica.in_flight) if client is replica.client else 0, client.engine.stats(),
                             getattr(client, "node_id", None))

    def shutdown(self) -> None:
        with self._lock:
            restarted, self._restarted = self._restarted, []
        for replica in self.replicas:
            replica.client.shutdown()
        for _, client in restarted:
            client.shutdown()

    # ---- on the run thread -------------------------------------------------------------------------
    def _on_step(self, replica: _Replica, result: StepResult) -> None:
        with self._lock:
            for output in result.outputs:
                if output.finished:
                    self._release(replica, output.request_id)
            for request_id in result.errors:
                self._release(replica, request_id)
        # the figures of all replicas, with this replica's step as the step the metrics window counts
        stats = dataclasses.replace(self.engine.stats(), last_step=result.stats.last_step)
        self.publish(StepResult(result.end_time, result.outputs, stats, result.errors))

    def _release(self, replica: _Replica, request_id: str) -> None:
        tokens = replica.in_flight.pop(request_id, None)
        self._owner.pop(request_id, None)
        if tokens is not None:
            self.router.done(replica.index, tokens)

    def _replica_died(self, replica: _Replica, error: EngineDeadError) -> None:
        logger.error("replica %d is down: %s", replica.index, error.message)
        with self._lock:
            self.router.set_up(replica.index, False)
            failed = list(replica.in_flight)
            for request_id in failed:
                self._release(replica, request_id)
        dead = EngineDeadError(f"engine replica {replica.index} is down ({error.message}); request failed")
        self.publish(StepResult(time.time(), [], self.engine.stats(), {rid: dead for rid in failed}))


def replica_gpus(num_replicas: int, device: str, gpu_count: int) -> list[int | None]:
    """One GPU each when the engines will run on CUDA (device "cuda", or "auto" with GPUs present),
    else none; ValueError when there are fewer GPUs than replicas."""
    if device == "cpu" or (device == "auto" and gpu_count == 0):
        return [None] * num_replicas
    if device not in ("auto", "cuda"):
        raise ValueError(f"replicas take one GPU each: give --device cuda or auto, not {device!r}")
    if gpu_count < num_replicas:
        raise ValueError(f"{num_replicas} replicas need {num_replicas} GPUs; {gpu_count} are visible")
    return list(range(num_replicas))


def split_cpus(num_replicas: int, cpus: list[int] | None = None) -> list[list[int]]:
    """This process's CPUs in num_replicas contiguous, equal shares (the remainder left unused)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if num_replicas > len(cpus):
        raise ValueError(f"{num_replicas} replicas need at least {num_replicas} CPUs; this process may use {len(cpus)}")
    share = len(cpus) // num_replicas
    return [cpus[i * share:(i + 1) * share] for i in range(num_replicas)]

