"""Replicas on a Ray cluster (`--distributed-executor-backend ray`): each engine is a Ray actor in
one bundle of a placement group (SPREAD over the nodes), the way vLLM places its engines.

Everything our side sends is the engine wire's msgpack bytes (wire.py): the engine's config,
commands, and its results; Ray only carries them (actor calls; Ray's own transport). On the
server a RayEngineClient is an EngineProcessClient whose commands are actor calls and whose
results a relay thread long-polls from the actor into an in-process socket, so ReplicaSet
follows Ray replicas exactly as it follows local processes. Needs `pip install tokenmill[ray]`
and a running cluster (`ray start --head`; RAY_ADDRESS or "auto").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import uuid

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine import wire
from tokenmill.engine.engine_client import EngineProcessClient, ForkedProcess
from tokenmill.engine.engine_process import EngineProcessArgs
from tokenmill.errors import TokenmillError
from tokenmill.executor.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

RESULTS_POLL_SECONDS = 0.25  # how long one results() call waits for the engine's next message
READY_TIMEOUT = 600.0


def _import_ray():
    try:
        import ray
    except ImportError:
        raise TokenmillError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") from None
    return ray


class EngineActor:
    """The engine on a Ray worker (wrapped by ray.remote in RayPlacement): an LLMEngine, its
    EngineLoop on a thread, and an outbox of wire messages for the server to collect."""

    def __init__(self, config_bytes: bytes, num_threads: int, tensor_parallel_size: int = 1) -> None:
        # set_cpu_threads splits its budget over the ranks as if they shared one machine; here each
        # rank has its own bundle of num_threads CPUs
        os.environ["OMP_NUM_THREADS"] = str(num_threads * tensor_parallel_size)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.codec = wire.Codec()
        self.outbox: queue.Queue[list[bytes]] = queue.Queue()
        self.loop = None
        try:
            from tokenmill.engine.engine_loop import EngineLoop, without_prompts
            from tokenmill.engine.engine_process import engine_info, serving_engine
            from tokenmill.engine.device_peaks import known_peaks

            config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
            if isinstance(config.rendezvous, dict):  # tensor parallel: its ranks are Ray actors too
                import ray

                config.rendezvous = Rendezvous(**config.rendezvous)
                config.rendezvous.host = ray.util.get_node_ip_address()  # where rank 0 hosts the store
            engine = serving_engine(config)
        except Exception as exc:
            self.outbox.put(self.codec.encode(wire.FAILED, wire.to_wire_error(exc)))
            return
        self.engine = engine
        self.loop = EngineLoop(engine, lambda result: self.outbox.put(
            self.codec.encode(wire.STEP, without_prompts(result))))
        self.outbox.put(self.codec.encode(wire.READY, engine_info(engine, known_peaks(engine.device))))
        threading.Thread(target=self._run, name="tokenmill-engine", daemon=True).start()

    def _run(self) -> None:
        fatal = self.loop.run()
        self.engine.shutdown()
        self.outbox.put(self.codec.encode(wire.DEAD, wire.to_wire_error(fatal)) if fatal is not None
                        else [b"stopped", b""])

    def where(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def submit(self, kind: bytes, payload: bytes) -> None:
        if self.loop is None:
            return
        if kind == wire.STOP:
            self.loop.request_stop()
        else:
            self.loop.submit(self.codec.decode(kind, payload))

    def results(self, timeout: float) -> list[list[bytes]]:
        """The messages waiting (at least one, or none after `timeout` seconds)."""
        try:
            batch = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self.outbox.get_nowait())
            except queue.Empty:
                return batch


class ActorProcess(ForkedProcess):
    """A Ray actor, as EngineProcessClient sees a process: alive until the relay saw it end."""

    def __init__(self, actor, pid: int) -> None:
        super().__init__(pid)
        self.actor = actor

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)
        self.exitcode = -9


class RayEngineClient(EngineProcessClient):
    """An engine actor behind the EngineProcessClient interface (see the module docstring)."""

    def __init__(self, actor, node_id: str, pid: int, num_cpus: int) -> None:
        self.actor = actor
        self.node_id = node_id
        self.num_cpus = num_cpus
        address = f"inproc://tokenmill-ray-{uuid.uuid4().hex}"
        # what ReplicaSet reads of a client's start arguments (the engine's config went to the actor)
        args = EngineProcessArgs(EngineConfig(), "ray", address, measure_peaks=False, cpu_cores=None)
        super().__init__(args, ActorProcess(actor, pid))
        self._relay = threading.Thread(target=self._relay_results, args=(address,), name="tokenmill-ray-relay",
                                       daemon=True)
        self._relay.start()

    def _open_sockets(self, args: EngineProcessArgs):
        """No command socket (commands are actor calls); results come from the relay, in this process."""
        context = zmq.Context.instance()
        results = context.socket(zmq.PULL)
        results.bind(args.results_address)
        return context, None, results

    def _close_sockets(self) -> None:
        self._relay.join(5)
        self._results.close(linger=0)

    def _relay_results(self, address: str) -> None:
        import ray

        push = self._context.socket(zmq.PUSH)
        push.connect(address)
        try:
            while True:
                try:
                    batch = ray.get(self.actor.results.remote(RESULTS_POLL_SECONDS))
                except Exception as exc:  # RayActorError and friends: the actor (or its node) is gone
                    logger.error("Ray engine actor on node %s is gone: %s", self.node_id[:12], type(exc).__name__)
                    self.process.exitcode = -9
                    return
                for frames in batch:
                    if frames[0] == b"stopped":
                        self.process.exitcode = 0
                        return
                    push.send_multipart(frames)
                    if frames[0] == wire.DEAD:
                        self.process.exitcode = 1
                        return
        finally:
            push.close(linger=1000)

    def _send(self, frames: list[bytes]) -> None:
        if self.process.is_alive():
            self.actor.submit.remote(*frames)

class RayPlacement:
    """One placement group for the replicas and their tensor-parallel ranks: a bundle of CPUs
    each, spread over the nodes; replica i's rank r is bundle i * tp + r."""

    def __init__(self, num_replicas: int, tensor_parallel_size: int = 1, cpus_per_rank: int | None = None) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING,
                     log_to_driver=True)
        self.tp = tensor_parallel_size
        num_bundles = num_replicas * tensor_parallel_size
        total = int(ray.cluster_resources().get("CPU", 0))
        self.cpus = cpus_per_rank or max(1, total // num_bundles)
        self.name = f"tokenmill-{uuid.uuid4().hex[:12]}"
        self.group = placement_group([{"CPU": self.cpus}] * num_bundles, strategy="SPREAD", name=self.name)
        try:
            ray.get(self.group.ready(), timeout=120)
        except Exception:
            raise TokenmillError(f"the Ray cluster cannot place {num_bundles} engines of {self.cpus} CPUs "
                                 f"(it has {total})") from None
        self.actor_class = ray.remote(max_concurrency=4)(EngineActor)

    def start(self, index: int, config: EngineConfig) -> RayEngineClient:
        import secrets

        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        first = index * self.tp
        if self.tp > 1:  # rank 0's actor starts the other ranks' actors in the next bundles
            config = dataclasses.replace(config, rendezvous=Rendezvous(
                "", 0, self.tp, token=secrets.token_hex(16), ray_placement_group=self.name,
                ray_bundles=list(range(first, first + self.tp))))
        actor = self.actor_class.options(
            num_cpus=self.cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=first)).remote(
            msgspec.msgpack.encode(config), self.cpus, self.tp)
        node_id, pid = ray.get(actor.where.remote(), timeout=READY_TIMEOUT)
        logger.info("replica %d: a Ray actor on node %s (pid %d, %d CPUs)", index, node_id[:12], pid, self.cpus)
        return RayEngineClient(actor, node_id, pid, self.cpus)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)
        ray.shutdown()
