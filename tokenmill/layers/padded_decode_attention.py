"""Decode attention with fixed shapes, for steps replayed from a CUDA graph.

A graph replays the kernels it captured on the same buffers with the same shapes, so nothing in
it may depend on the step beyond the contents of its input tensors: no host syncs, no shapes
taken from the longest context. Here a decode step is B sequences (padded up to a captured batch
size) of one new token each, every sequence given NB blocks (padded up to a captured count). One
int64 tensor [B, 2 + NB] holds each row's token id, position and block table, and everything
else (cache slots, the length mask) is derived from it on the device. Rows past the real
sequences and block-table entries past a sequence's blocks name a scratch block that the block
pool never hands out: padding rows write their keys and values there and read only it, and the
length mask hides it from real rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.layers.attention import CacheGeometry, write_kv


@dataclass
class PaddedDecodeMetadata:
    """What every layer of one padded decode step reads: device tensors of fixed shapes."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B] position of each row's new token
    block_table: torch.Tensor  # [B, NB]
    write_index: torch.Tensor  # [kv_heads * B] rows of the cache viewed as [kv_heads * num_slots, head_dim]
    attn_mask: torch.Tensor  # [1, B, 1, NB * block_size] additive: nothing past each row's new token


def padded_decode_inputs(token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                         batch: int, num_blocks: int, block_size: int, scratch_block: int) -> torch.Tensor:
    """The [batch, 2 + num_blocks] int64 rows (on the CPU) of a decode step: the real sequences
    first, each with the blocks that cover its new token, then padding rows on the scratch block."""
    rows = []
    for token, position, table in zip(token_ids, positions, block_tables):
        blocks = table[: position // block_size + 1]
        rows.append([token, position, *blocks] + [scratch_block] * (num_blocks - len(blocks)))
    rows += [[0, 0] + [scratch_block] * num_blocks] * (batch - len(rows))
    return torch.tensor(rows, dtype=torch.int64)


def padded_decode_metadata(inputs: torch.Tensor, geometry: CacheGeometry) -> PaddedDecodeMetadata:
    """The step's metadata from its input rows, with device ops only (so it is captured too)."""
    block_size = geometry.block_size
    positions, table = inputs[:, 1].contiguous(), inputs[:, 2:]
    batch, num_blocks = table.shape
    slots = table.gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
    head_offsets = torch.arange(geometry.num_kv_heads, device=inputs.device)[:, None] * (geometry.num_blocks * block_size)
    kv_pos = torch.arange(num_blocks * block_size, device=inputs.device)
    mask = torch.zeros(batch, num_blocks * block_size, dtype=geometry.dtype, device=inputs.device)
    mask.masked_fill_(kv_pos[None, :] > positions[:, None], float("-inf"))
    return PaddedDecodeMetadata(
        input_ids=inputs[:, 0].contiguous(),
        positions=positions,
        block_table=table,
        write_index=(head_offsets + slots[None, :]).flatten(),
        attn_mask=mask.view(1, batch, 1, -1),
    )


class PaddedDecodeAttention:
    """Paged decode attention over PaddedDecodeMetadata: gathers each row's NB blocks of keys and
    values and runs one SDPA call, KV heads as its batch and the rows as its heads. It reads the
    blocks past a sequence's length too (masked), the price of shapes that stay fixed."""

    def forward(
        self,
        q: torch.Tensor,  # [B, num_heads, head_dim]
        k: torch.Tensor,  # [B, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_kv_heads, num_blocks, block_size, head_dim]
        v_cache: torch.Tensor,
        metadata: PaddedDecodeMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
        batch, groups = q.shape[0], q.shape[1] // num_kv_heads
        write_kv(k_cache, v_cache, metadata.write_index, k, v)
        both = keys_and_values(k_cache, v_cache)
        if both is not None:  # one gather for keys and values: a kernel less a layer
            gathered = both[:, :, metadata.block_table]  # [2, kv_heads, B, NB, block_size, head_dim]
            keys, values = gathered[0], gathered[1]
        else:
            keys, values = k_cache[:, metadata.block_table], v_cache[:, metadata.block_table]
        keys = keys.view(num_kv_heads, batch, -1, head_dim).to(q.dtype)  # [kv_heads, B, L, head_dim]
        values = values.view(num_kv_heads, batch, -1, head_dim).to(q.dtype)
        queries = q.view(batch, num_kv_heads, groups, head_dim).transpose(0, 1)  # [kv_heads, B, groups, head_dim]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=metadata.attn_mask, scale=scale)
        return attn.transpose(0, 1).reshape(batch, -1)  # [B, num_heads * head_dim]


def keys_and_values(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """[2, ...] over both caches where the value cache lies at a fixed offset after the key cache
    in one storage (the model runner's [layers, 2, ...] pool), else None."""
    offset = v_cache.storage_offset() - k_cache.storage_offset()
    if (v_cache.untyped_storage().data_ptr() != k_cache.untyped_storage().data_ptr() or offset <= 0
            or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride()):
        return None
    return k_cache.as_strided((2, *k_cache.shape), (offset, *k_cache.stride()))
