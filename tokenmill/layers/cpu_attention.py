"""Decode attention on x86 CPUs through our C++ kernel (csrc/paged_decode.cpp).

The pure-PyTorch decode gathers every sequence's keys into a contiguous copy before its batched
matmul: on the default model at batch 64 that copy and the value bags cost ~45 ms of a ~120 ms
step on 2 cores. The kernel reads keys and values in place through the block table, once each,
with no horizontal sums (keys are stored by column): ~20 ms. Prefill chunks after cached tokens
(prefix-cache hits, the later chunks of a long prompt), in bf16, go through
csrc/prefill_attention.cpp's paged op, reading the cache through the block table as they are: no
gathered copy, no padding to the longest chunk or context, no mask (elsewhere: the padded SDPA).

The kernel is built with the others in layers/cpu_kernels.py. It needs AVX-512; where it cannot
be built, or with TOKENMILL_CPU_KERNELS=0, decode falls back to the PyTorch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.attention import (
    AttentionBackend, AttentionMetadata, CacheGeometry, DecodeStepLayout, PrefillBucket, StepLayout,
    TorchPagedAttention, prefill_kernel_applies,
)
from tokenmill.layers.cpu_kernels import kernels_enabled, load_cpu_kernels
from tokenmill.layers.rotary import RopeStep

MAX_QUERY_GROUPS = 8
MAX_HEAD_DIM = 256


def kernel_supports(head_dim: int, num_query_groups: int, dtype: torch.dtype) -> bool:
    return (
        head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and num_query_groups <= MAX_QUERY_GROUPS
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


@dataclass
class KernelDecodeBucket:
    """One query per sequence, for the kernel: it reads the cache in place through the block table."""

    token_index: torch.Tensor  # [B] flat index of each sequence's query token
    covers_batch: bool  # the bucket is the whole step, in order
    block_table: torch.Tensor  # [B, max_blocks] int64, each sequence's blocks (padded with its first)
    seq_lens: torch.Tensor  # [B] int64, cached + new tokens
    context_len: int  # max_blocks * block_size: the width of the scores


@dataclass
class KernelPrefillChunks:
    """Prefill chunks after cached tokens, for paged_prefill_attention_ (csrc/prefill_attention.cpp):
    no padding to the longest chunk or context, no mask."""

    starts: torch.Tensor  # [C] int64: first flat token of each chunk
    lengths: torch.Tensor  # [C] int64
    context_lens: torch.Tensor  # [C] int64: tokens cached before it
    block_table: torch.Tensor  # [C, max_blocks] int64


@dataclass
class CpuAttentionMetadata(AttentionMetadata):
    slots: torch.Tensor  # [T] int64: block * block_size + offset of each new token, for write_kv


class CpuPagedAttention(TorchPagedAttention):
    """TorchPagedAttention with decode buckets computed by the C++ kernel.

    Keys live in the cache by column, [kv_heads, blocks, head_dim / 2, block_size, 2] (see the
    kernel's header), so this backend also writes them and, for prefill chunks, gathers them.
    Values keep PyTorch's row layout.
    """

    def build_metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                       geometry: CacheGeometry) -> CpuAttentionMetadata:
        if all(n == 1 for n in query_lens):
            return self._decode_metadata(context_lens, block_tables, geometry)
        common = super().build_metadata(query_lens, context_lens, block_tables, geometry)
        # head 0's cache rows are the slots themselves
        return CpuAttentionMetadata(**vars(common), slots=common.write_index[: common.num_tokens].contiguous())

    def _decode_metadata(self, context_lens: list[int], block_tables: list[list[int]],
                         geometry: CacheGeometry) -> CpuAttentionMetadata:
        """A decode-only step, without StepLayout's tensor ops (DecodeStepLayout)."""
        decode = DecodeStepLayout.build(context_lens, block_tables, geometry)
        bucket = KernelDecodeBucket(token_index=torch.arange(len(context_lens)), covers_batch=True,
                                    block_table=decode.block_table, seq_lens=decode.seq_lens,
                                    context_len=decode.context_len)
        return CpuAttentionMetadata(positions=decode.positions, write_index=decode.write_index,
                                    num_tokens=len(context_lens), decode=bucket, prefill=None, fresh_prefills=[],
                                    slots=decode.slots)

    def _prefill_bucket(self, step: StepLayout, members: torch.Tensor,
                        geometry: CacheGeometry) -> PrefillBucket | KernelPrefillChunks:
        if not prefill_kernel_applies(geometry.device, geometry.dtype, geometry.head_dim):
            return super()._prefill_bucket(step, members, geometry)
        num_blocks = step.bucket_blocks(members, geometry.block_size)
        return KernelPrefillChunks(starts=step.query_starts[members], lengths=step.query_lens[members],
                                   context_lens=step.context_lens[members],
                                   block_table=step.block_table[members, :num_blocks].contiguous())

    def _prefill_into(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      bucket: PrefillBucket | KernelPrefillChunks, scale: float) -> None:
        if isinstance(bucket, PrefillBucket):
            return super()._prefill_into(out, q, k_cache, v_cache, bucket, scale)
        torch.ops.tokenmill.paged_prefill_attention_.default(out, q, k_cache, v_cache, bucket.block_table,
                                                             bucket.context_lens, bucket.starts, bucket.lengths, scale)

    def _decode_bucket(self, step: StepLayout, members: torch.Tensor,
                       geometry: CacheGeometry) -> KernelDecodeBucket:
        num_blocks = step.bucket_blocks(members, geometry.block_size)
        return KernelDecodeBucket(
            token_index=step.query_starts[members],
            covers_batch=len(members) == len(step.query_lens),
            block_table=step.block_table[members, :num_blocks].contiguous(),
            seq_lens=step.query_lens[members] + step.context_lens[members],
            context_len=num_blocks * geometry.block_size,
        )

    def _write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: CpuAttentionMetadata,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        torch.ops.tokenmill.write_kv.default(k, v, k_cache, v_cache, metadata.slots)

    def _gather_keys(self, k_cache: torch.Tensor, gather_index: torch.Tensor, context_len: int) -> torch.Tensor:
        num_kv_heads, num_blocks, block_size, head_dim = k_cache.shape
        blocks = self._gather(k_cache.view(num_kv_heads * num_blocks, -1), gather_index)
        rows = blocks.view(-1, head_dim // 2, block_size, 2).transpose(1, 2)  # [.., block_size, head_dim / 2, 2]
        return rows.reshape(num_kv_heads, -1, context_len, head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: KernelDecodeBucket,
                scale: float) -> torch.Tensor:
        """q: [B, num_heads, head_dim] -> [B, num_heads * head_dim]."""
        out = torch.ops.tokenmill.paged_decode.default(q.contiguous(), k_cache, v_cache, bucket.block_table,
                                                       bucket.seq_lens, scale, bucket.context_len)
        return out.view(q.shape[0], -1)  # [B, num_heads, head_dim] -> [B, num_heads * head_dim]


def fused_decode_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, rope: RopeStep,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: CpuAttentionMetadata,
                           scale: float) -> torch.Tensor:
    """A decode-only step's attention from the fused q/k/v projection [T, (heads + 2 kv_heads) * head_dim]
    in one op: rotary (the kernel's, rope.tables is None), the KV write and CpuPagedAttention's decode,
    bit for bit, without the Python between them."""
    bucket = metadata.decode
    return torch.ops.tokenmill.decode_attention.default(
        qkv, num_heads, num_kv_heads, rope.positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache,
        metadata.slots, bucket.block_table, bucket.seq_lens, scale, bucket.context_len)


def default_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                              num_query_groups: int) -> AttentionBackend:
    """The fastest backend that supports this model on this device."""
    use_kernel = (
        kernels_enabled()
        and device.type == "cpu"
        and kernel_supports(head_dim, num_query_groups, dtype)
        and load_cpu_kernels()
    )
    return CpuPagedAttention() if use_kernel else TorchPagedAttention()
