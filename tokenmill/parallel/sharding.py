"""Megatron-style tensor parallelism applied to a plain, fully loaded model.

The model code stays TP-agnostic: rank r builds the same DecoderForCausalLM from a config with
1/N of the heads and of the MLP width, copies its slices of the full weights into it, and wraps
the few modules whose outputs must be combined across ranks:

  qkv_proj, gate_up_proj   column-parallel: this rank's heads / MLP columns, no communication
  o_proj, down_proj        row-parallel: partial sums, all-reduced (bias added on rank 0 only)
  embed_tokens             vocab-parallel: this rank's rows, zeros elsewhere, all-reduced
  lm_head                  vocab-parallel: this rank's logits, all-gathered
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.models.llama import DecoderForCausalLM


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    rank: int
    world_size: int
    group: object  # a torch.distributed ProcessGroup (Gloo on CPU, NCCL on CUDA)


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
    check_divisible(config, world_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns; partial outputs are summed over ranks."""

    def __init__(self, linear: nn.Module, group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.group.allreduce([out]).wait()
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding; other tokens contribute zeros, then all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        self.group.allreduce([x]).wait()
        return x


class VocabParallelLMHead(nn.Module):
    """This rank's slice of the vocabulary's logits, all-gathered into the full row."""

    def __init__(self, linear: nn.Module, vocab_size: int, group, world_size: int) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.group = group
        self.world_size = world_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        self.group.allgather([parts], [local]).wait()
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def shard_model(full: DecoderForCausalLM, shard: ShardInfo) -> DecoderForCausalLM:
    """This rank's part of a loaded model (a new module; `full` can be freed afterwards)."""
    config = full.config
    rank, world = shard.rank, shard.world_size
    local_config = shard_config(config, world)
    dtype, device = full.embed_tokens.weight.dtype, full.embed_tokens.weight.device
    with torch.device("meta"):
        net = DecoderForCausalLM(local_config, full.rotary.max_positions)
    net = net.to(dtype=dtype).to_empty(device=device)
    net.rotary = full.rotary
    d = config.head_dim
    q, kv = local_config.num_attention_heads * d, local_config.num_key_value_heads * d
    q_full, kv_full = config.num_attention_heads * d, config.num_key_value_heads * d
    inter, inter_full = local_config.intermediate_size, config.intermediate_size
    rows_qkv = [(rank * q, q), (q_full + rank * kv, kv), (q_full + kv_full + rank * kv, kv)]
    rows_gate_up = [(rank * inter, inter), (inter_full + rank * inter, inter)]
    with torch.no_grad():
        for src, dst in zip(full.layers, net.layers):
            _copy_rows(src.self_attn.qkv_proj, dst.self_attn.qkv_proj, rows_qkv)
            _copy_rows(src.mlp.gate_up_proj, dst.mlp.gate_up_proj, rows_gate_up)
            _copy_columns(src.self_attn.o_proj, dst.self_attn.o_proj, rank * q, q, rank)
            _copy_columns(src.mlp.down_proj, dst.mlp.down_proj, rank * inter, inter, rank)
            for name in ("input_layernorm", "post_attention_layernorm"):
                getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
            for name in ("q_norm", "k_norm"):
                if getattr(src.self_attn, name) is not None:
                    getattr(dst.self_attn, name).load_state_dict(getattr(src.self_attn, name).state_dict())
            dst.self_attn.o_proj = RowParallelLinear(dst.self_attn.o_proj, shard.group)
            dst.mlp.down_proj = RowParallelLinear(dst.mlp.down_proj, shard.group)
        net.norm.load_state_dict(full.norm.state_dict())
        vocab_per_rank = -(-config.vocab_size // world)
        start = rank * vocab_per_rank
        embed = _padded_rows(full.embed_tokens.weight, start, vocab_per_rank)
        net.embed_tokens = VocabParallelEmbedding(embed, start, shard.group)
        head_weight = full.embed_tokens.weight if full.lm_head is None else full.lm_head.weight
        head = nn.Linear(config.hidden_size, vocab_per_rank, bias=False, device=device, dtype=dtype)
        head.weight.copy_(_padded_rows(head_weight, start, vocab_per_rank))
        net.lm_head = VocabParallelLMHead(head, config.vocab_size, shard.group, world)
    net.eval()
    return net


def _copy_rows(src: nn.Linear, dst: nn.Linear, row_ranges: list[tuple[int, int]]) -> None:
    dst.weight.copy_(torch.cat([src.weight[start:start + n] for start, n in row_ranges]))
    if src.bias is not None:
        dst.bias.copy_(torch.cat([src.bias[start:start + n] for start, n in row_ranges]))


def _copy_columns(src: nn.Linear, dst: nn.Linear, start: int, n: int, rank: int) -> None:
    dst.weight.copy_(src.weight[:, start:start + n])
    if src.bias is not None:  # added once, after the all-reduce sums the ranks' partial outputs
        dst.bias.copy_(src.bias if rank == 0 else torch.zeros_like(src.bias))


def _padded_rows(weight: torch.Tensor, start: int, n: int) -> torch.Tensor:
    rows = weight[start:start + n]
    if rows.shape[0] < n:  # the last rank's slice of a vocabulary that does not divide evenly
        rows = torch.cat([rows, rows.new_zeros(n - rows.shape[0], rows.shape[1])])
    return rows.clone()
