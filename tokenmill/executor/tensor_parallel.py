"""Tensor-parallel execution: rank 0 (the engine's process) plus N-1 worker processes.

The scheduler runs once, on rank 0. Each step, rank 0 broadcasts the step's ForwardInput as JSON
over the process group; every rank runs the same forward on its shard, meeting at the
all-reduces; only rank 0 samples. Workers are `python -m tokenmill.executor.tp_worker` processes
that rendezvous through a TCPStore that rank 0 binds to 127.0.0.1 (to MASTER_ADDR under a
multi-node torchrun). Every key lives under a random token the workers are given (in their
environment), so another process on the machine can neither read the spec nor join the group;
no Python objects are ever unpickled from the wire.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.errors import EngineDeadError
from tokenmill.executor.rendezvous import TOKEN_ENV, Rendezvous
from tokenmill.layers.parallel import Communicator
from tokenmill.models.loader import LoadedModel, load_model, load_model_config
from tokenmill.models.sharding import check_divisible
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.worker.forward_input import ForwardInput
from tokenmill.worker.model_runner import ModelRunner, pool_dtype

if TYPE_CHECKING:
    from tokenmill.engine.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
SPEC_KEY = "worker_spec"  # published before loading: every rank loads at once
NUM_BLOCKS_KEY = "num_kv_blocks"  # published once rank 0 has sized the KV pool


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker process is gone; the engine cannot continue."""


def open_master_store(rendezvous: Rendezvous) -> tuple[dist.Store, socket.socket | None]:
    """Rank 0's store, its keys under the token, and the socket it listens on (keep it open as long
    as the store). Spawning its own workers, rank 0 hosts the store on rendezvous.host only (port 0:
    any free one, filled in); under torchrun it joins the store torchrun hosts at MASTER_ADDR:PORT."""
    if not rendezvous.spawn_workers:
        return open_worker_store(rendezvous.host, rendezvous.port, rendezvous.world_size, rendezvous.token), None
    listener = socket.create_server((rendezvous.host, rendezvous.port), backlog=128)
    rendezvous.port = listener.getsockname()[1]
    store = dist.TCPStore(rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=True,
                          timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False, master_listen_fd=listener.fileno())
    return dist.PrefixStore(f"tokenmill/{rendezvous.token}", store), listener


def open_worker_store(host: str, port: int, world_size: int, token: str) -> dist.Store:
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    return dist.PrefixStore(f"tokenmill/{token}", store)


@dataclass
class WorkerSpec:
    """What every rank must agree on; rank 0 publishes it in the store as JSON."""

    model: str | None
    dtype: str
    device: str
    quantization: str | None
    max_model_len: int | None
    block_size: int
    num_threads: int
    kv_cache_dtype: str = "auto"
    dtype_was_auto: bool = False  # rank 0 chose dtype: so may the loader its rounding (loader.load_model)


def make_group(store: dist.Store, rank: int, world_size: int, device: torch.device):
    """A process group object of our own (no torch.distributed global state)."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)


def broadcast_step(group, batch: ForwardInput | None) -> None:
    """Rank 0: send the step (None = stop) to every worker."""
    payload = b"" if batch is None else batch.to_json()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if payload:
        group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0).wait()


def receive_step(group) -> ForwardInput | None:
    """Workers: the next step, or None when rank 0 stops."""
    length = torch.zeros(1, dtype=torch.int64)
    group.broadcast(length, 0).wait()
    if int(length) == 0:
        return None
    payload = torch.empty(int(length), dtype=torch.uint8)
    group.broadcast(payload, 0).wait()
    return ForwardInput.from_json(bytes(payload.numpy()))


class TensorParallelExecutor:
    """Rank 0's side: owns the worker processes and its own shard.

    The constructor checks the split, opens the store, publishes the spec and starts the workers
    (they load their shards while rank 0 loads its own in load_model()); init_kv_cache() then
    publishes the KV pool size, connects the process group and builds rank 0's runner.
    """

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        world = config.tensor_parallel_size
        check_divisible(load_model_config(config.model), world)  # before any process starts
        self.config, self.device, self.dtype = config, device, dtype
        self.kv_cache_dtype = pool_dtype(config.cache.kv_cache_dtype, dtype, device, config.dtype == "auto")
        self.world_size = world
        self.spec = WorkerSpec(
            model=config.model, dtype=str(dtype).removeprefix("torch."), device=config.device,
            quantization=config.quantization,
            max_model_len=config.scheduler.max_model_len, block_size=config.cache.block_size,
            num_threads=torch.get_num_threads(), kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."),
            dtype_was_auto=config.dtype == "auto",
        )
        rendezvous = config.rendezvous or Rendezvous("127.0.0.1", 0, world, token=secrets.token_hex(16))
        self.comm = Communicator(0, world)
        self.workers: list = []  # subprocess.Popen, or ray_workers.RayWorkerHandle (same poll/wait/kill)
        self.runner: ModelRunner | None = None
        self._stopped = False
        self.store, self._listener = open_master_store(rendezvous)
        self.store.set(SPEC_KEY, json.dumps(asdict(self.spec)))
        if rendezvous.spawn_workers and rendezvous.ray_placement_group:
            from tokenmill.executor.ray_workers import start_ray_workers

            self.workers = start_ray_workers(rendezvous, self.spec.num_threads)
        elif rendezvous.spawn_workers:
            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", TOKEN_ENV: rendezvous.token}
            for rank in range(1, world):
                self.workers.append(subprocess.Popen(
                    [sys.executable, "-m", "tokenmill.executor.tp_worker", rendezvous.host, str(rendezvous.port),
                     str(rank), str(world)], env=env))
        atexit.register(self.shutdown)  # never leave workers behind, even without LLM.close()

    def load_model(self) -> LoadedModel:
        try:
            self.loaded = load_model(self.config.model, self.dtype, self.device, self.config.scheduler.max_model_len,
                                     shard=self.comm, quantization=self.config.quantization,
                                     dtype_was_auto=self.config.dtype == "auto",
                                     tokenizer=self.config.tokenizer_kind)
        except Exception:
            self.shutdown()
            raise
        return self.loaded

    def init_kv_cache(self, num_blocks: int) -> None:
        self.store.set(NUM_BLOCKS_KEY, str(num_blocks))
        try:
            self.comm.group = make_group(self.store, 0, self.world_size, self.device)
        except Exception as exc:
            self.shutdown()
            raise WorkerDiedError(f"tensor-parallel workers did not join: {exc}") from exc
        self.runner = ModelRunner(self.loaded.model, num_blocks, self.spec.block_size, self.device, self.dtype,
                                  kv_cache_dtype=self.kv_cache_dtype)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        batch = ForwardInput.from_scheduler_output(scheduler_output)
        try:
            broadcast_step(self.comm.group, batch)
            logits = self.runner.forward(batch)
        except Exception as exc:  # a collective failed, or the ranks are out of step: nothing can be retried
            self.check_health()
            raise WorkerDiedError(f"tensor-parallel step failed: {exc}") from exc
        return self.runner.sample(scheduler_output, logits)  # rank 0 alone: a failure here can be retried

    def check_health(self) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            code = worker.poll()
            if code is not None:
                raise WorkerDiedError(f"tensor-parallel worker {rank} exited with status {code}")

    def shutdown(self) -> None:
        """Stop the workers (politely, then firmly); safe to call twice."""
        connected = self.comm.group is not None
        if not self._stopped and connected and all(w.poll() is None for w in self.workers):
            try:
                broadcast_step(self.comm.group, None)
            except RuntimeError:
                pass
        self._stopped = True
        if not connected:  # still loading: nothing to say goodbye on
            for worker in self.workers:
                worker.kill()
        for worker in self.workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
