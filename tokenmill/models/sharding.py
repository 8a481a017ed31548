"""How a model is split for tensor parallelism (Megatron-style), applied to the plain model.

The model code stays TP-agnostic: rank r builds the same DecoderForCausalLM from a config with
1/N of the heads, of the MLP width and of the vocabulary, loads only its slices of the checkpoint
(each tensor is sliced as it streams in, so a rank never holds the full model), and wraps the few
modules whose outputs must be combined across ranks (layers/parallel.py):

  qkv_proj, gate_up_proj   column-parallel: this rank's heads / MLP columns, no communication
  o_proj, down_proj        row-parallel: partial sums, all-reduced (bias added on rank 0 only)
  embed_tokens             vocab-parallel: this rank's rows, zeros elsewhere, all-reduced
  lm_head                  vocab-parallel: this rank's logits, all-gathered

Quantized weights (a GGUF's) are cut the same way: output rows anywhere, input columns only on
the weight's group boundaries (else a ModelLoadError says which tensor); a quantized embedding is
dequantized first (the vocab-parallel embedding holds a plain table), while the head keeps this
rank's rows of the quantized table, so that its logits are computed as on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError, ModelLoadError
from tokenmill.layers.parallel import Communicator, RowParallelLinear, VocabParallelEmbedding, VocabParallelLMHead
from tokenmill.layers.quantized import QuantizedLinear, QuantizedWeight


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """Raise a clear error when the model cannot be split over world_size ranks."""
    for what, count in [("attention heads", config.num_attention_heads),
                        ("KV heads", config.num_key_value_heads),
                        ("MLP width (intermediate_size)", config.intermediate_size)]:
        if count % world_size:
            raise InvalidParameterError(
                f"tensor_parallel_size {world_size} does not divide the model's {count} {what}",
                param="tensor_parallel_size")


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank holds: 1/N of the heads, MLP width and (rounded up) vocabulary."""
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        vocab_size=-(-config.vocab_size // world_size),
    )


def shard_weights(weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], config: ModelConfig,
                  comm: Communicator, quantized_tables: dict[str, QuantizedWeight] | None = None,
                  ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """This rank's slice of each checkpoint tensor (HF names), as it streams past. A quantized
    vocabulary table goes out dequantized; its quantized rows, zero-padded like the plain ones,
    go into quantized_tables under "embed_tokens" or "lm_head" (for vocab_parallel_head)."""
    rank, world = comm.rank, comm.world_size
    vocab_rows = -(-config.vocab_size // world)
    for name, tensor in weights:
        kind = name.split(".")[-2] if name.count(".") >= 1 else name
        quantized = isinstance(tensor, QuantizedWeight)
        if kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # column-parallel: output rows
            rows = tensor.shape[0] // world
            part = slice(rank * rows, (rank + 1) * rows)
            yield name, tensor.rows(part) if quantized else tensor[part]
        elif kind in ("o_proj", "down_proj"):  # row-parallel: input columns; the bias is added once
            if name.endswith("bias"):
                yield name, tensor if rank == 0 else torch.zeros_like(tensor)
            elif quantized:
                columns = tensor.shape[1] // world
                try:
                    yield name, tensor.columns(rank * columns, (rank + 1) * columns)
                except ValueError as exc:
                    raise ModelLoadError(f"cannot split {name} over {world} ranks: {exc}") from None
            else:
                columns = tensor.shape[1] // world
                yield name, tensor[:, rank * columns:(rank + 1) * columns]
        elif kind in ("embed_tokens", "lm_head"):  # vocab-parallel rows, zero-padded on the last rank
            part = slice(rank * vocab_rows, (rank + 1) * vocab_rows)
            if quantized:
                rows = _padded_rows(tensor.rows(part), vocab_rows)
                if quantized_tables is not None:
                    quantized_tables[kind] = rows
                yield name, rows.dequantize()
                continue
            rows = tensor[part]
            if rows.shape[0] < vocab_rows:
                rows = torch.cat([rows, rows.new_zeros(vocab_rows - rows.shape[0], rows.shape[1])])
            yield name, rows
        else:  # norms: every rank holds them
            yield name, tensor


def _padded_rows(q: QuantizedWeight, rows: int) -> QuantizedWeight:
    """q with zero rows appended up to `rows` (their products are 0, cut off after the gather)."""
    missing = rows - q.shape[0]
    if missing <= 0:
        return q
    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(missing, t.shape[1])]).contiguous()
    return dataclasses.replace(q, codes=pad(q.codes), scales=pad(q.scales), offsets=pad(q.offsets))


def vocab_parallel_head(quantized_tables: dict[str, QuantizedWeight], tied: bool) -> QuantizedWeight | None:
    """The quantized rows the head multiplies (its own table, or a tied model's embedding), if quantized."""
    return quantized_tables.get("embed_tokens" if tied else "lm_head")


def wrap_parallel(net: nn.Module, vocab_size: int, comm: Communicator, head: QuantizedWeight | None = None) -> None:
    """Put the communicating wrappers around a loaded shard (built from shard_config); `head`: this
    rank's rows of a quantized head table, kept quantized (the plain shard serves the embedding)."""
    for layer in net.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, comm)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)
    net.untie_lm_head()  # a tied model's head shares the embedding shard
    start = comm.rank * net.embed_tokens.weight.shape[0]
    net.lm_head = VocabParallelLMHead(net.lm_head if head is None else QuantizedLinear(head), vocab_size, comm)
    net.embed_tokens = VocabParallelEmbedding(net.embed_tokens, start, comm)
