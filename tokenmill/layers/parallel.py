"""Layers that combine their outputs across tensor-parallel ranks (Megatron-style).

Each wraps a plain layer holding this rank's slice of the weights:

  RowParallelLinear        o_proj, down_proj: partial sums over this rank's input columns, all-reduced
  VocabParallelEmbedding   embed_tokens: this rank's rows, zeros for other tokens, all-reduced
  VocabParallelLMHead      lm_head: this rank's slice of the logits, all-gathered
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class Communicator:
    """This rank's place in the group; `group` (a torch.distributed ProcessGroup: Gloo on CPU, NCCL
    on CUDA) is connected after the weights are loaded."""

    rank: int
    world_size: int
    group: object | None = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([parts], [tensor]).wait()
        return parts


class RowParallelLinear(nn.Module):
    """A linear layer over this rank's input columns; partial outputs are summed over ranks."""

    def __init__(self, linear: nn.Module, comm: Communicator) -> None:
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        self.comm.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding; other tokens contribute zeros, then all-reduce."""

    def __init__(self, embedding: nn.Embedding, start: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.start = start
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0)
        self.comm.all_reduce(x)
        return x


class VocabParallelLMHead(nn.Module):
    """This rank's slice of the vocabulary's logits, all-gathered into the full row."""

    def __init__(self, linear: nn.Module, vocab_size: int, comm: Communicator) -> None:
        super().__init__()
        self.linear = linear
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.comm.all_gather(self.linear(hidden).contiguous())
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]
