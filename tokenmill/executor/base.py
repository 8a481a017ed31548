"""The executor: what runs the model for the engine, in this process or over tensor-parallel ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from tokenmill.config import EngineConfig
from tokenmill.models.loader import LoadedModel
from tokenmill.outputs import ModelRunnerOutput

if TYPE_CHECKING:  # the boundary type only; the executor never looks inside it
    from tokenmill.engine.scheduler_output import SchedulerOutput


class Executor(Protocol):
    """Loads the model, holds the KV cache, runs steps.

    Lifecycle: load_model() once, then init_kv_cache() once the engine has sized the pool, then
    execute() per step; check_health() raises EngineDeadError when part of it is gone.
    """

    kv_cache_dtype: torch.dtype  # what the KV pool holds (ModelRunner.pool_dtype)

    def load_model(self) -> LoadedModel: ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


def create_executor(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Executor:
    """One process, or rank 0 of a tensor-parallel group (its workers start loading now)."""
    if config.tensor_parallel_size > 1:
        from tokenmill.executor.tensor_parallel import TensorParallelExecutor

        return TensorParallelExecutor(config, device, dtype)
    from tokenmill.executor.local import LocalExecutor

    return LocalExecutor(config, device, dtype)
