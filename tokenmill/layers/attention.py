"""Paged attention over a ragged batch.

Every sequence in a step contributes its new tokens (a prefill chunk or one decode token).
Their keys/values are written into the block-paged KV cache through the slot mapping; then
each new token attends causally to everything its sequence has cached. Sequences are padded
into at most two buckets (decodes, q_len == 1, and prefill chunks) so a long prefill does not
pad every decode to its length.

Cache layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] for K and for V. With
KV heads outermost, gathering a bucket's blocks with one index_select yields keys already laid
out as [kv_heads * batch, context, head_dim], ready for batched matmuls without a transpose copy.

The metadata is built once per step and shared by all layers. A backend only has to implement
`forward`; faster kernels can replace `TorchPagedAttention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionBucket:
    """Sequences padded to a common query length and a common context length."""

    is_decode: bool  # every query length is 1
    covers_batch: bool  # the bucket is the whole step, in order: no gather/scatter of queries needed
    query_index: torch.Tensor  # [B, Q] flat index of each query token (padding -> 0)
    token_index: torch.Tensor  # [num_valid] flat index of each real query, in row-major (b, i) order
    valid: torch.Tensor  # [B, Q] bool, real query tokens
    gather_index: torch.Tensor  # [kv_heads * B * max_blocks] rows of the cache viewed as [kv_heads * num_blocks, -1]
    context_len: int  # max_blocks * block_size
    block_table: torch.Tensor  # [B, max_blocks] int64, each sequence's blocks (padded with its first)
    seq_lens: torch.Tensor  # [B] int64, cached + new tokens of each sequence
    # decode only: for embedding_bag over the value cache viewed as [kv_heads * num_slots, head_dim],
    # the row of every (kv head, sequence, query group, context position), and each bag's start
    value_index: torch.Tensor | None
    value_offsets: torch.Tensor | None
    attn_mask: torch.Tensor  # additive; decode: [kv_heads * B, 1, L], prefill: [1, B, Q * groups, L]


@dataclass(frozen=True)
class CacheGeometry:
    """What the metadata builder needs to know about the paged KV cache and the model."""

    block_size: int
    num_blocks: int
    num_kv_heads: int
    num_query_groups: int  # query heads per KV head
    dtype: torch.dtype
    device: torch.device


@dataclass
class AttentionMetadata:
    """What every attention layer needs for one step."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    write_index: torch.Tensor  # [kv_heads * T] rows of the cache viewed as [kv_heads * num_slots, head_dim]
    buckets: list[AttentionBucket]
    num_tokens: int


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    geometry: CacheGeometry,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens lie back to back in the flat batch.

    query_lens[i] new tokens follow context_lens[i] tokens already in the cache.
    """
    block_size = geometry.block_size
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
    num_tokens = int(q_lens.sum())
    query_starts = torch.cumsum(q_lens, 0) - q_lens
    seq_ids = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    positions = torch.arange(num_tokens) - query_starts[seq_ids] + ctx_lens[seq_ids]
    max_blocks = max(len(t) for t in block_tables)
    table = torch.tensor([t + [t[0]] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    slots = table[seq_ids, positions // block_size] * block_size + positions % block_size
    head_offsets = torch.arange(geometry.num_kv_heads)[:, None]
    write_index = (head_offsets * (geometry.num_blocks * block_size) + slots[None, :]).flatten()

    is_decode = q_lens == 1
    buckets = []
    for decode, members in ((True, torch.nonzero(is_decode).flatten()), (False, torch.nonzero(~is_decode).flatten())):
        if len(members):
            buckets.append(_build_bucket(decode, members, q_lens, ctx_lens, query_starts, table, geometry))
    device = geometry.device
    return AttentionMetadata(
        positions=positions.to(device), write_index=write_index.to(device), buckets=buckets, num_tokens=num_tokens
    )


def _build_bucket(
    is_decode: bool,
    members: torch.Tensor,
    q_lens: torch.Tensor,
    ctx_lens: torch.Tensor,
    query_starts: torch.Tensor,
    table: torch.Tensor,
    geometry: CacheGeometry,
) -> AttentionBucket:
    block_size, num_blocks, num_kv_heads = geometry.block_size, geometry.num_blocks, geometry.num_kv_heads
    device = geometry.device
    batch = len(members)
    b_q_lens = q_lens[members]
    b_ctx = ctx_lens[members]
    b_seq_lens = b_q_lens + b_ctx
    max_q = int(b_q_lens.max())
    bucket_blocks = int((b_seq_lens.max() + block_size - 1) // block_size)
    context_len = bucket_blocks * block_size
    offsets = torch.arange(max_q)
    valid = offsets[None, :] < b_q_lens[:, None]  # [B, Q]
    query_index = torch.where(valid, query_starts[members][:, None] + offsets[None, :], 0)
    head_offsets = torch.arange(num_kv_heads)[:, None, None] * num_blocks
    gather_index = (head_offsets + table[members, :bucket_blocks][None]).flatten()
    # Query i of a sequence sits at position ctx + i and sees keys 0..ctx+i (and no padding).
    # Padding queries see key 0 only, so no row of the mask is empty (an empty row gives NaN).
    kv_pos = torch.arange(context_len)
    q_pos = torch.where(valid, b_ctx[:, None] + offsets[None, :], 0)
    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < b_seq_lens[:, None, None])
    bias = torch.zeros(allowed.shape, dtype=geometry.dtype).masked_fill(~allowed, float("-inf"))  # [B, Q, L]
    value_index = value_offsets = None
    if is_decode:  # [kv_heads * B, 1, L]
        mask = bias[None].expand(num_kv_heads, batch, 1, context_len).reshape(num_kv_heads * batch, 1, context_len)
        slots = table[members, :bucket_blocks].repeat_interleave(block_size, dim=1) * block_size \
            + (kv_pos % block_size)[None, :]  # [B, L]
        head_rows = torch.arange(num_kv_heads)[:, None, None, None] * (num_blocks * block_size)
        groups = geometry.num_query_groups
        value_index = (head_rows + slots[None, :, None, :]).expand(-1, -1, groups, -1).flatten()
        value_offsets = torch.arange(num_kv_heads * batch * groups) * context_len
        value_index, value_offsets = value_index.to(device), value_offsets.to(device)
    else:  # [1, B, Q * groups, L]
        mask = bias.repeat_interleave(geometry.num_query_groups, dim=1).unsqueeze(0)
    return AttentionBucket(
        is_decode=is_decode,
        covers_batch=is_decode and batch == len(q_lens),
        value_index=value_index,
        value_offsets=value_offsets,
        query_index=query_index.to(device),
        token_index=query_index[valid].to(device),
        valid=valid.to(device),
        gather_index=gather_index.to(device),
        context_len=context_len,
        block_table=table[members, :bucket_blocks].contiguous().to(device),
        seq_lens=b_seq_lens.to(device),
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
    """Pure-PyTorch paged attention (CPU and CUDA): batched matmuls for decodes, SDPA for prefills.

    Gathered keys/values go into a workspace reused by every layer and step: on CPU, gathering
    into fresh multi-megabyte tensors costs several times the copy itself in page faults.
    """

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def _gather(self, rows: torch.Tensor, index: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """rows[index] written into workspace slot 0 (keys) or 1 (values)."""
        num_rows, row_size = len(index), rows.shape[1]
        ws = self._workspace
        if ws is None or ws.shape[1] < num_rows or ws.shape[2] != row_size or ws.dtype != rows.dtype \
                or ws.device != rows.device:
            ws = self._workspace = rows.new_empty(2, max(num_rows, 2 * (0 if ws is None else ws.shape[1])), row_size)
        return torch.index_select(rows, 0, index, out=ws[slot, :num_rows])

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        head_dim = k_cache.shape[-1]
        num_heads = q.shape[1]
        self._write_keys(k_cache, metadata.write_index, k.transpose(0, 1).reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, metadata.write_index, v.transpose(0, 1).reshape(-1, head_dim))
        buckets = metadata.buckets
        if buckets[0].covers_batch:  # a pure decode step (the only bucket): no scatter into `out`
            return self._decode(q, k_cache, v_cache, buckets[0], scale)
        out = q.new_empty(metadata.num_tokens, num_heads * head_dim)
        for bucket in buckets:
            if bucket.is_decode:
                out[bucket.token_index] = self._decode(q[bucket.query_index[:, 0]], k_cache, v_cache, bucket, scale)
            else:
                out[bucket.token_index] = self._prefill(q, k_cache, v_cache, bucket, scale)
        return out

    def _write_keys(self, k_cache: torch.Tensor, write_index: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [N, head_dim] into the cache rows write_index (of the cache viewed as [-1, head_dim])."""
        k_cache.view(-1, keys.shape[1]).index_copy_(0, write_index, keys)

    def _gather_keys(self, k_cache: torch.Tensor, bucket: AttentionBucket) -> torch.Tensor:
        """The bucket's keys as [kv_heads, B, context, head_dim] (a workspace view)."""
        num_kv_heads, num_blocks, _, head_dim = k_cache.shape
        keys = self._gather(k_cache.view(num_kv_heads * num_blocks, -1), bucket.gather_index)
        return keys.view(num_kv_heads, -1, bucket.context_len, head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: AttentionBucket,
                scale: float) -> torch.Tensor:
        """q: [B, num_heads, head_dim], one query per sequence -> [B, num_heads * head_dim]."""
        num_kv_heads, _, _, head_dim = k_cache.shape
        batch, groups = q.shape[0], q.shape[1] // num_kv_heads
        queries = q.view(batch, num_kv_heads, groups, head_dim).transpose(0, 1)
        queries = queries.reshape(num_kv_heads * batch, groups, head_dim)  # [kv_heads * B, groups, head_dim]
        keys = self._gather_keys(k_cache, bucket).view(num_kv_heads * batch, bucket.context_len, head_dim)
        scores = torch.baddbmm(bucket.attn_mask, queries, keys.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        # probs @ values without gathering the values: a weighted sum of cache rows per bag
        attn = F.embedding_bag(bucket.value_index, v_cache.view(-1, head_dim), bucket.value_offsets,
                               mode="sum", per_sample_weights=probs.view(-1))  # [kv_heads * B * groups, head_dim]
        return attn.view(num_kv_heads, batch, groups * head_dim).transpose(0, 1).reshape(batch, -1)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: AttentionBucket,
                 scale: float) -> torch.Tensor:
        """Queries of the bucket's chunks (taken from the flat q) -> [num_valid, num_heads * head_dim]."""
        num_kv_heads, num_blocks, _, head_dim = k_cache.shape
        batch, max_q = bucket.query_index.shape
        num_heads = q.shape[1]
        groups = num_heads // num_kv_heads
        # keys/values: [kv_heads, B, L, head_dim], contiguous
        shape = (num_kv_heads, batch, bucket.context_len, head_dim)
        keys = self._gather_keys(k_cache, bucket)
        values = self._gather(v_cache.view(num_kv_heads * num_blocks, -1), bucket.gather_index, slot=1).view(shape)
        # queries: [kv_heads, B, Q * groups, head_dim]; SDPA sees kv_heads as batch, B as heads
        queries = q[bucket.query_index].view(batch, max_q, num_kv_heads, groups, head_dim)
        queries = queries.permute(2, 0, 1, 3, 4).reshape(num_kv_heads, batch, max_q * groups, head_dim)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bucket.attn_mask, scale=scale)
        attn = attn.view(num_kv_heads, batch, max_q, groups, head_dim).permute(1, 2, 0, 3, 4)
        return attn.reshape(batch, max_q, num_heads * head_dim)[bucket.valid]


@dataclass
class AttentionContext:
    """Handed to the model for one forward: which backend, the step metadata, each layer's cache."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_index]
        return self.backend.forward(q, k, v, k_cache, v_cache, self.metadata, scale)
