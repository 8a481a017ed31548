"""LocalExecutor: the whole model in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.config import EngineConfig
from tokenmill.models.loader import LoadedModel, load_model
from tokenmill.outputs import ModelRunnerOutput
from tokenmill.worker import decode_graphs
from tokenmill.worker.model_runner import ModelRunner, pool_dtype

if TYPE_CHECKING:
    from tokenmill.engine.scheduler_output import SchedulerOutput


class LocalExecutor:
    """Runs every step on one device through one ModelRunner."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.kv_cache_dtype = pool_dtype(config.cache.kv_cache_dtype, dtype, device, config.dtype == "auto")
        self.loaded: LoadedModel | None = None
        self.runner: ModelRunner | None = None

    def load_model(self) -> LoadedModel:
        self.loaded = load_model(self.config.model, self.dtype, self.device, self.config.scheduler.max_model_len,
                                 quantization=self.config.quantization, dtype_was_auto=self.config.dtype == "auto",
                                 tokenizer=self.config.tokenizer_kind)
        return self.loaded

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.loaded.model, num_blocks, self.config.cache.block_size, self.device, self.dtype,
                                  decode_graphs=decode_graphs.uses_decode_graphs(self.device, self.config.enforce_eager),
                                  kv_cache_dtype=self.kv_cache_dtype)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def check_health(self) -> None:
        """Nothing here can die apart from this process."""

    def shutdown(self) -> None:
        """Nothing to stop."""
