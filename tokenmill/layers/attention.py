"""Paged attention over a ragged batch.

Every sequence in a step contributes its new tokens (a prefill chunk or one decode
token). Their keys/values are written into the block-paged KV cache through the
slot mapping; then each new token attends causally to everything its sequence has
cached. Sequences are padded into at most two buckets (decodes, q_len == 1, and
prefill chunks) so a long prefill does not pad every decode to its length.

The metadata is built once per step and shared by all layers. A backend only has
to implement `forward`; faster kernels can replace `TorchPagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionBucket:
    """Sequences padded to a common query length and a common context length."""

    query_index: torch.Tensor  # [B, Q] flat index of each query token (padding -> 0)
    token_index: torch.Tensor  # [num_valid] flat index of each real query, in row-major (b, i) order
    valid: torch.Tensor  # [B, Q] bool, real query tokens
    block_tables: torch.Tensor  # [B, max_blocks] (padding -> the sequence's first block)
    attn_mask: torch.Tensor  # [B, 1, Q * num_query_groups, max_blocks * block_size] bool


@dataclass
class AttentionMetadata:
    """What every attention layer needs for one step."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    buckets: list[AttentionBucket]
    num_tokens: int


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_query_groups: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens lie back to back in the flat batch.

    query_lens[i] new tokens follow context_lens[i] tokens already in the cache.
    """
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    num_tokens = int(q_lens.sum())
    query_starts = torch.cumsum(q_lens, 0) - q_lens
    seq_ids = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    positions = torch.arange(num_tokens) - query_starts[seq_ids] + ctx_lens[seq_ids]
    max_blocks = max(len(t) for t in block_tables)
    table = torch.tensor([t + [t[0]] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    slot_mapping = table[seq_ids, positions // block_size] * block_size + positions % block_size

    is_decode = q_lens == 1
    buckets = []
    for members in (torch.nonzero(is_decode).flatten(), torch.nonzero(~is_decode).flatten()):
        if len(members) == 0:
            continue
        buckets.append(
            _build_bucket(members, q_lens, ctx_lens, query_starts, table, block_size, num_query_groups, device)
        )
    return AttentionMetadata(
        positions=positions.to(device), slot_mapping=slot_mapping.to(device), buckets=buckets, num_tokens=num_tokens
    )


def _build_bucket(
    members: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    query_starts: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    num_query_groups: int,
    device: torch.device,
) -> AttentionBucket:
    b_q_lens = q_lens[members]
    b_ctx = ctx_lens[members]
    b_seq_lens = b_q_lens + b_ctx
    max_q = int(b_q_lens.max())
    num_blocks = int((b_seq_lens.max() + block_size - 1) // block_size)
    max_kv = num_blocks * block_size
    offsets = torch.arange(max_q)
    valid = offsets[None, :] < b_q_lens[:, None]  # [B, Q]
    query_index = torch.where(valid, query_starts[members][:, None] + offsets[None, :], 0)
    # Query i of a sequence sits at position ctx + i and sees keys 0..ctx+i (and no padding).
    # Padding queries see key 0 only, so no row of the mask is empty (an empty row gives NaN).
    kv_pos = torch.arange(max_kv)
    q_pos = torch.where(valid, b_ctx[:, None] + offsets[None, :], 0)
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < b_seq_lens[:, None, None])
    mask = mask.repeat_interleave(num_query_groups, dim=1).unsqueeze(1)  # [B, 1, Q*G, max_kv]
    return AttentionBucket(
        query_index=query_index.to(device),
        token_index=query_index[valid].to(device),
        valid=valid.to(device),
        block_tables=table[members, :num_blocks].contiguous().to(device),
        attn_mask=mask.to(device),
    )


class AttentionBackend(Protocol):
    """Computes attention for one layer given that layer's cache and the step metadata."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Pure-PyTorch paged attention (CPU and CUDA), built on scaled_dot_product_attention."""

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        num_heads = q.shape[1]
        groups = num_heads // num_kv_heads
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
        out = q.new_empty(metadata.num_tokens, num_heads * head_dim)
        k_blocks = k_cache.view(num_blocks, -1)
        v_blocks = v_cache.view(num_blocks, -1)
        for bucket in metadata.buckets:
            batch, max_q = bucket.query_index.shape
            max_kv = bucket.block_tables.shape[1] * block_size
            flat_tables = bucket.block_tables.flatten()
            # keys/values: [B, num_kv_heads, max_kv, head_dim]
            keys = k_blocks.index_select(0, flat_tables).view(batch, max_kv, num_kv_heads, head_dim).transpose(1, 2)
            values = v_blocks.index_select(0, flat_tables).view(batch, max_kv, num_kv_heads, head_dim).transpose(1, 2)
            # Fold the query heads sharing a KV head into the query axis: [B, kv_heads, Q * groups, head_dim]
            queries = (
                q[bucket.query_index]
                .view(batch, max_q, num_kv_heads, groups, head_dim)
                .permute(0, 2, 1, 3, 4)
                .reshape(batch, num_kv_heads, max_q * groups, head_dim)
            )
            attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bucket.attn_mask, scale=scale)
            attn = attn.view(batch, num_kv_heads, max_q, groups, head_dim).permute(0, 2, 1, 3, 4)
            out[bucket.token_index] = attn.reshape(batch, max_q, num_heads * head_dim)[bucket.valid]
        return out


@dataclass
class AttentionContext:
    """Handed to the model for one forward: which backend, the step metadata, each layer's cache."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_index]
        return self.backend.forward(q, k, v, k_cache, v_cache, self.metadata, scale)
