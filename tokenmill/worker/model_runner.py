"""ModelRunner: the only place a SchedulerOutput becomes tensors, logits and tokens."""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.layers.attention import (
    AttentionBackend,
    AttentionContext,
    CacheGeometry,
    build_attention_metadata,
)
from tokenmill.layers.cpu_attention import default_attention_backend
from tokenmill.layers.sampler import SampledToken, sample
from tokenmill.models.llama import DecoderForCausalLM


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return int(config.kv_bytes_per_token(torch.tensor([], dtype=dtype).element_size())) * block_size


class ModelRunner:
    """Holds the model and the KV cache tensors; runs one forward + sampling per step."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,
    ) -> None:
        config = model.config
        self.model = model
        self.device = device
        self.geometry = CacheGeometry(
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_heads=config.num_key_value_heads,
            num_query_groups=config.num_query_groups,
            dtype=dtype,
            device=device,
        )
        self.backend = backend or default_attention_backend(device, dtype, config.head_dim, config.num_query_groups)
        # [layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]; zeroed so that unwritten
        # slots gathered with a block are finite (masked, but NaN * 0 would still poison softmax).
        shape = (config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> list[SampledToken]:
        """Run one step; returns one sampled token per sequence that samples, in order."""
        logits = self.forward(scheduler_output)
        if logits is None:
            return []
        return sample(logits, [s.sampling for s in scheduler_output.sequences if s.sampling is not None])

    @torch.inference_mode()
    def forward(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """The forward pass: writes the new K/V; returns float32 logits [num_samples, vocab] of the
        sequences that sample this step (their last new token), or None if none does."""
        seqs = scheduler_output.sequences
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        metadata = build_attention_metadata(
            query_lens=[len(s.token_ids) for s in seqs],
            context_lens=[s.num_computed_tokens for s in seqs],
            block_tables=[s.block_ids for s in seqs],
            geometry=self.geometry,
        )
        ctx = AttentionContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches)
        hidden = self.model(input_ids, metadata.positions, ctx)  # [T, hidden]

        sample_rows, end = [], 0
        for s in seqs:
            end += len(s.token_ids)
            if s.sampling is not None:
                sample_rows.append(end - 1)
        if not sample_rows:
            return None
        rows = torch.tensor(sample_rows, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))  # [num_samples, vocab]
