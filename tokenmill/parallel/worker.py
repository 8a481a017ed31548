"""A tensor-parallel worker: `python -m tokenmill.parallel.worker '<WorkerSpec JSON>'`.

Joins rank 0's process group, loads the model and keeps only its shard, then runs the forward
pass of every step rank 0 broadcasts, until rank 0 says stop or goes away.
"""

from __future__ import annotations

import json
import logging
import sys

import torch
import torch.distributed as dist

from tokenmill.models.loader import load_model, maybe_pack_weights
from tokenmill.parallel.executor import COLLECTIVE_TIMEOUT, WorkerSpec, make_group, receive_step
from tokenmill.parallel.sharding import ShardInfo, shard_model
from tokenmill.platform import resolve_device, resolve_dtype
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill.parallel.worker")


def run(spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.num_threads)
    device = resolve_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank)
    dtype = resolve_dtype(spec.dtype, device)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, False, COLLECTIVE_TIMEOUT)
    group = make_group(store, spec.rank, spec.world_size, device)
    loaded = load_model(spec.model, dtype, device, spec.max_model_len, pack_weights=False, with_tokenizer=False)
    shard = shard_model(loaded.model, ShardInfo(spec.rank, spec.world_size, group))
    del loaded
    maybe_pack_weights(shard, dtype, device)
    runner = ModelRunner(shard, spec.num_blocks, spec.block_size, device, dtype)
    while (step := receive_step(group)) is not None:
        runner.forward(step)


def main() -> int:
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = WorkerSpec(**json.loads(sys.argv[1]))
    try:
        run(spec)
    except RuntimeError as exc:  # rank 0 went away mid-collective: nothing left to serve
        logger.warning("worker %d stopping: %s", spec.rank, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
