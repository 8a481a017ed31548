"""A tensor-parallel worker: `python -m tokenmill.executor.tp_worker HOST PORT RANK WORLD_SIZE`
(spawned by rank 0), or any rank > 0 of a torchrun launch (see tokenmill.cli).

Reads the WorkerSpec rank 0 published in the store, joins the process group, loads the model and
keeps only its shard, then runs the forward pass of every step rank 0 broadcasts, until rank 0
says stop or goes away.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

from tokenmill.errors import TokenmillError
from tokenmill.executor.rendezvous import TOKEN_ENV
from tokenmill.executor.tensor_parallel import (
    NUM_BLOCKS_KEY, SPEC_KEY, WorkerSpec, make_group, open_worker_store, receive_step,
)
from tokenmill.layers.parallel import Communicator
from tokenmill.models.loader import load_model
from tokenmill.platform import limit_onednn_primitive_cache, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from tokenmill.worker.forward_input import MalformedStepError
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill.executor.tp_worker")


def run(host: str, port: int, rank: int, world_size: int) -> None:
    store = open_worker_store(host, port, world_size, os.environ.get(TOKEN_ENV, ""))
    try:
        spec = WorkerSpec(**json.loads(store.get(SPEC_KEY)))
    except (ValueError, TypeError) as exc:
        raise MalformedStepError(f"the worker spec is malformed: {exc}") from None
    torch.set_num_threads(spec.num_threads)
    limit_onednn_primitive_cache()
    device = resolve_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
    dtype = resolve_dtype(spec.dtype, device)
    comm = Communicator(rank, world_size)
    loaded = load_model(spec.model, dtype, device, spec.max_model_len, shard=comm, tokenizer="none",
                        quantization=spec.quantization, dtype_was_auto=spec.dtype_was_auto)
    num_blocks = int(store.get(NUM_BLOCKS_KEY))  # rank 0 sizes the KV pool once its shard is loaded
    comm.group = make_group(store, rank, world_size, device)
    runner = ModelRunner(loaded.model, num_blocks, spec.block_size, device, dtype,
                         kv_cache_dtype=resolve_kv_cache_dtype(spec.kv_cache_dtype, dtype))
    while (step := receive_step(comm.group)) is not None:
        runner.forward(step)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, port, rank, world_size = (argv or sys.argv[1:])[:4]
    try:
        run(host, int(port), int(rank), int(world_size))
    except TokenmillError as exc:
        logger.error("worker %s: %s", rank, exc.message)
        return 2
    except MalformedStepError as exc:  # never run a step we cannot read
        logger.error("worker %s stopping: %s", rank, exc)
        return 1
    except RuntimeError as exc:  # rank 0 went away mid-collective: nothing left to serve
        logger.warning("worker %s stopping: %s", rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
