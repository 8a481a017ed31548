"""Paged attention over a ragged batch.

Every sequence in a step contributes its new tokens (a prefill chunk or one decode token).
Their keys/values are written into the block-paged KV cache through the slot mapping; then
each new token attends causally to everything its sequence has cached. Sequences are padded
into at most two buckets (decodes, q_len == 1, and prefill chunks) so a long prefill does not
pad every decode to its length.

Cache layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] for K and for V. With
KV heads outermost, gathering a bucket's blocks with one index_select yields keys already laid
out as [kv_heads * batch, context, head_dim], ready for batched matmuls without a transpose copy.

A backend builds the step's metadata once (what its own kernels read, nothing more) and runs
`forward` for every layer with it; faster kernels can replace parts of `TorchPagedAttention`.
On CPUs with the AVX2 build, `TorchPagedAttention` runs a whole step in one op instead
(csrc/decode_attention_rows.cpp): each new token a query of its own (TokenQueries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_kernels import decode_attention_rows_available, prefill_attention_available


ROWS_MAX_QUERY_GROUPS = 8  # query heads per kv head that decode_attention_rows takes (csrc/decode_rows.h)


@dataclass(frozen=True)
class CacheGeometry:
    """What the metadata builders need to know about the paged KV cache and the model."""

    block_size: int
    num_blocks: int
    num_kv_heads: int
    num_query_groups: int  # query heads per KV head
    head_dim: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class PrefillBucket:
    """Prefill chunks padded to a common query length Q and context length L (B sequences)."""

    token_index: torch.Tensor  # [num_valid] flat index of each real query token, in row-major (b, i) order
    query_index: torch.Tensor  # [B, Q] flat index of each query token (padding -> 0)
    valid: torch.Tensor  # [B, Q] bool, real query tokens
    gather_index: torch.Tensor  # [kv_heads * B * max_blocks] rows of the cache viewed as [kv_heads * num_blocks, -1]
    context_len: int  # L = max_blocks * block_size
    attn_mask: torch.Tensor  # [1, B, Q * groups, L] additive: causal within the chunk, nothing past the sequence


@dataclass
class DecodeBucket:
    """One query per sequence, for the PyTorch decode path (B sequences, context padded to L)."""

    token_index: torch.Tensor  # [B] flat index of each sequence's query token
    covers_batch: bool  # the bucket is the whole step, in order: no gather/scatter of queries needed
    context_len: int  # L = max_blocks * block_size
    block_table: torch.Tensor  # [B, max_blocks] int64, and seq_lens [B]: for the CPU op (decode_attention_rows)
    seq_lens: torch.Tensor
    # the PyTorch path's (None where the CPU op reads the cache: ~0.8 ms a step less to build)
    gather_index: torch.Tensor | None = None  # [kv_heads * B * max_blocks] rows of the cache viewed as [kv_heads * num_blocks, -1]
    attn_mask: torch.Tensor | None = None  # [kv_heads * B, 1, L] additive: nothing past each sequence's length
    # embedding_bag over the value cache viewed as [kv_heads * num_slots, head_dim]: the row of every
    # (kv head, sequence, query group, context position) [kv_heads * B * groups * L], and each bag's start
    value_index: torch.Tensor | None = None
    value_offsets: torch.Tensor | None = None  # [kv_heads * B * groups]


@dataclass
class TokenQueries:
    """A step with prompt chunks on the PyTorch backend's CPU op (decode_attention_rows, the AVX2
    build): every new token a query of its own over the first seq_lens[t] cache rows of its sequence
    (block_table[t]), written before. Each prompt row is then the row a decode step computes, bit for
    bit, whether the prompt came whole, in chunks, after a prefix-cache hit or recomputed after
    preemption; and no query is padded to the longest chunk or context."""

    block_table: torch.Tensor  # [T, max_blocks] int64: each token's sequence's blocks
    seq_lens: torch.Tensor  # [T] int64: each token's position + 1


@dataclass
class AttentionMetadata:
    """What every attention layer of one step reads; built once per step by the backend."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    write_index: torch.Tensor  # [kv_heads * T] rows of the cache viewed as [kv_heads * num_slots, head_dim]
    num_tokens: int  # T
    decode: object | None  # the backend's decode bucket (sequences with one new token), if any
    prefill: object | None  # the backend's bucket of sequences with several new tokens after cached ones, if any
    # (TokenQueries: every token of the step, decodes too)
    # sequences with several new tokens and nothing cached: (first flat token, number of tokens) of
    # each; they attend to the step's own keys and values, without the cache or any padding
    fresh_prefills: list[tuple[int, int]]


@dataclass
class StepLayout:
    """The step's sequences as tensors (on the CPU): the common ground of every backend's metadata.

    Sequence i has query_lens[i] new tokens after context_lens[i] cached ones; its new tokens lie
    back to back in the flat batch from query_starts[i].
    """

    query_lens: torch.Tensor  # [S] int64
    context_lens: torch.Tensor  # [S] int64
    query_starts: torch.Tensor  # [S] int64
    block_table: torch.Tensor  # [S, max_blocks] int64, each padded with its first block
    positions: torch.Tensor  # [T]
    write_index: torch.Tensor  # [kv_heads * T]

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              geometry: CacheGeometry) -> StepLayout:
        block_size = geometry.block_size
        q_lens = torch.tensor(query_lens, dtype=torch.int64)
        ctx_lens = torch.tensor(context_lens, dtype=torch.int64)
        query_starts = torch.cumsum(q_lens, 0) - q_lens
        seq_ids = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T]
        positions = torch.arange(int(q_lens.sum())) - query_starts[seq_ids] + ctx_lens[seq_ids]
        max_blocks = max(len(t) for t in block_tables)
        table = torch.tensor([t + [t[0]] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
        slots = table[seq_ids, positions // block_size] * block_size + positions % block_size  # [T]
        head_offsets = torch.arange(geometry.num_kv_heads)[:, None] * (geometry.num_blocks * block_size)
        write_index = (head_offsets + slots[None, :]).flatten()
        return cls(q_lens, ctx_lens, query_starts, table, positions, write_index)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def members(self, decode: bool) -> torch.Tensor:
        """Indices of the decode sequences (one new token) or of the prefill chunks after cached tokens."""
        is_decode = self.query_lens == 1
        return torch.nonzero(is_decode if decode else ~is_decode & (self.context_lens > 0)).flatten()

    def fresh_prefills(self) -> list[tuple[int, int]]:
        """(first flat token, number of tokens) of each prefill chunk with nothing cached before it."""
        fresh = (self.query_lens > 1) & (self.context_lens == 0)
        return list(zip(self.query_starts[fresh].tolist(), self.query_lens[fresh].tolist()))

    def bucket_blocks(self, members: torch.Tensor, block_size: int) -> int:
        """Blocks that cover the longest of these sequences."""
        seq_lens = self.query_lens[members] + self.context_lens[members]
        return int((seq_lens.max() + block_size - 1) // block_size)

    def gather_index(self, members: torch.Tensor, num_blocks: int, geometry: CacheGeometry) -> torch.Tensor:
        """[kv_heads * B * num_blocks]: the members' first num_blocks blocks, per KV head, as rows of
        the cache viewed as [kv_heads * blocks_in_pool, -1]."""
        head_offsets = torch.arange(geometry.num_kv_heads)[:, None, None] * geometry.num_blocks
        return (head_offsets + self.block_table[members, :num_blocks][None]).flatten()


@dataclass
class DecodeStepLayout:
    """A decode-only step (one new token per sequence) as StepLayout and the decode buckets would
    lay it out, the same values, built from Python ints: their two dozen small tensor ops cost
    0.3-0.6 ms, most of the bookkeeping of a one-stream step."""

    positions: torch.Tensor  # [B] int64: each new token's position (its sequence's cached tokens)
    slots: torch.Tensor  # [B] int64: block * block_size + offset of each new token
    write_index: torch.Tensor  # [kv_heads * B], as StepLayout's
    block_table: torch.Tensor  # [B, max_blocks] int64, each padded with its first block, as the buckets'
    seq_lens: torch.Tensor  # [B] int64: cached + new tokens
    context_len: int  # max_blocks * block_size

    @classmethod
    def build(cls, context_lens: list[int], block_tables: list[list[int]], geometry: CacheGeometry) -> DecodeStepLayout:
        block_size = geometry.block_size
        slots = [table[pos // block_size] * block_size + pos % block_size
                 for table, pos in zip(block_tables, context_lens)]
        num_blocks = max(context_lens) // block_size + 1  # covers every sequence and its new token
        table = [t[:num_blocks] + [t[0]] * (num_blocks - len(t[:num_blocks])) for t in block_tables]
        head_rows = geometry.num_blocks * block_size
        write_index = [head * head_rows + slot for head in range(geometry.num_kv_heads) for slot in slots]
        return cls(positions=torch.tensor(context_lens, dtype=torch.int64), slots=torch.tensor(slots, dtype=torch.int64),
                   write_index=torch.tensor(write_index, dtype=torch.int64),
                   block_table=torch.tensor(table, dtype=torch.int64),
                   seq_lens=torch.tensor([pos + 1 for pos in context_lens], dtype=torch.int64),
                   context_len=num_blocks * block_size)


def prefill_bucket(step: StepLayout, members: torch.Tensor, geometry: CacheGeometry) -> PrefillBucket:
    block_size, device = geometry.block_size, geometry.device
    q_lens, ctx = step.query_lens[members], step.context_lens[members]
    max_q = int(q_lens.max())
    num_blocks = step.bucket_blocks(members, block_size)
    context_len = num_blocks * block_size
    offsets = torch.arange(max_q)
    valid = offsets[None, :] < q_lens[:, None]  # [B, Q]
    query_index = torch.where(valid, step.query_starts[members][:, None] + offsets[None, :], 0)
    # Query i of a sequence sits at position ctx + i and sees keys 0..ctx+i (and no padding).
    # Padding queries see key 0 only, so no row of the mask is empty (an empty row gives NaN).
    kv_pos = torch.arange(context_len)
    q_pos = torch.where(valid, ctx[:, None] + offsets[None, :], 0)
    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < (ctx + q_lens)[:, None, None])
    bias = torch.zeros(allowed.shape, dtype=geometry.dtype).masked_fill(~allowed, float("-inf"))  # [B, Q, L]
    return PrefillBucket(
        token_index=query_index[valid].to(device),
        query_index=query_index.to(device),
        valid=valid.to(device),
        gather_index=step.gather_index(members, num_blocks, geometry).to(device),
        context_len=context_len,
        attn_mask=bias.repeat_interleave(geometry.num_query_groups, dim=1).unsqueeze(0).to(device),
    )


def token_queries(step: StepLayout, geometry: CacheGeometry) -> TokenQueries:
    every = torch.arange(len(step.query_lens))
    num_blocks = step.bucket_blocks(every, geometry.block_size)
    seq_ids = torch.repeat_interleave(every, step.query_lens)  # [T]
    return TokenQueries(block_table=step.block_table[seq_ids, :num_blocks], seq_lens=step.positions + 1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, write_index: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """The step's keys and values [T, kv_heads, head_dim] into the cache rows write_index (of each
    cache, in the row layout, viewed as [-1, head_dim]), rounded to the cache's dtype."""
    head_dim = k_cache.shape[-1]
    for cache, rows in ((k_cache, k), (v_cache, v)):
        cache.view(-1, head_dim).index_copy_(0, write_index, rows.transpose(0, 1).reshape(-1, head_dim).to(cache.dtype))


def fused_decode_attention_rows(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, rope, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """A decode-only step's attention from the fused q/k/v projection [B, (heads + 2 kv_heads) * head_dim]
    on the AVX2 build, in one op: rotary (the kernel's, rope.tables is None), the KV write and
    TorchPagedAttention's decode (decode_attention_rows), bit for bit, without the Python between them."""
    bucket = metadata.decode
    return torch.ops.tokenmill.fused_decode_attention_rows.default(
        qkv, num_heads, num_kv_heads, rope.positions, rope.cos_cache, rope.sin_cache, k_cache, v_cache,
        metadata.write_index, bucket.block_table, bucket.seq_lens, scale)


def as_cached(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """rows as a later step reads them back from `cache`: rounded to its dtype where that is
    narrower (a float32 model's 16-bit pool), so that a prompt attends to the same keys and values
    whether they were computed in its own step or found in the cache."""
    return rows if cache.dtype == rows.dtype else rows.to(cache.dtype).to(rows.dtype)


class AttentionBackend(Protocol):
    """Attention for every layer of a step: builds the step's metadata once, then runs each layer."""

    def build_metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                       geometry: CacheGeometry) -> AttentionMetadata: ...

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
    """Pure-PyTorch paged attention (CPU and CUDA): batched matmuls for decodes, SDPA for prefills;
    on the AVX2 build's CPUs, decode_attention_rows for decode steps and steps with prompts alike.

    Gathered keys/values go into a workspace reused by every layer and step: on CPU, gathering
    into fresh multi-megabyte tensors costs several times the copy itself in page faults.
    """

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    # ---- metadata, once per step -------------------------------------------------------------
    def build_metadata(self, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                       geometry: CacheGeometry) -> AttentionMetadata:
        if rows_kernel_applies(geometry) and all(n == 1 for n in query_lens):
            decode = DecodeStepLayout.build(context_lens, block_tables, geometry)
            bucket = DecodeBucket(torch.arange(len(context_lens)), True, decode.context_len, decode.block_table,
                                  decode.seq_lens)
            return AttentionMetadata(positions=decode.positions, write_index=decode.write_index,
                                     num_tokens=len(context_lens), decode=bucket, prefill=None, fresh_prefills=[])
        step = StepLayout.build(query_lens, context_lens, block_tables, geometry)
        if rows_kernel_applies(geometry) and max(query_lens) > 1:
            return AttentionMetadata(positions=step.positions, write_index=step.write_index, num_tokens=step.num_tokens,
                                     decode=None, prefill=token_queries(step, geometry), fresh_prefills=[])
        decodes, prefills = step.members(decode=True), step.members(decode=False)
        return AttentionMetadata(
            positions=step.positions.to(geometry.device),
            write_index=step.write_index.to(geometry.device),
            num_tokens=step.num_tokens,
            decode=self._decode_bucket(step, decodes, geometry) if len(decodes) else None,
            prefill=self._prefill_bucket(step, prefills, geometry) if len(prefills) else None,
            fresh_prefills=step.fresh_prefills(),
        )

    def _prefill_bucket(self, step: StepLayout, members: torch.Tensor, geometry: CacheGeometry) -> PrefillBucket:
        return prefill_bucket(step, members, geometry)

    def _decode_bucket(self, step: StepLayout, members: torch.Tensor, geometry: CacheGeometry) -> DecodeBucket:
        block_size, num_kv_heads, groups = geometry.block_size, geometry.num_kv_heads, geometry.num_query_groups
        device, batch = geometry.device, len(members)
        num_blocks = step.bucket_blocks(members, block_size)
        context_len = num_blocks * block_size
        seq_lens = step.query_lens[members] + step.context_lens[members]
        block_table = step.block_table[members, :num_blocks].contiguous()
        token_index, covers_batch = step.query_starts[members].to(device), batch == len(step.query_lens)
        if rows_kernel_applies(geometry):  # decode_attention_rows reads the rest itself
            return DecodeBucket(token_index, covers_batch, context_len, block_table, seq_lens)
        kv_pos = torch.arange(context_len)
        bias = torch.zeros(batch, context_len, dtype=geometry.dtype).masked_fill(
            kv_pos[None, :] >= seq_lens[:, None], float("-inf"))  # [B, L]
        slots = step.block_table[members, :num_blocks].repeat_interleave(block_size, dim=1) * block_size \
            + (kv_pos % block_size)[None, :]  # [B, L]
        head_rows = torch.arange(num_kv_heads)[:, None, None, None] * (geometry.num_blocks * block_size)
        value_index = (head_rows + slots[None, :, None, :]).expand(-1, -1, groups, -1).flatten()
        return DecodeBucket(
            token_index=token_index,
            covers_batch=covers_batch,
            context_len=context_len,
            block_table=block_table.to(device),
            seq_lens=seq_lens.to(device),
            gather_index=step.gather_index(members, num_blocks, geometry).to(device),
            attn_mask=bias.repeat(num_kv_heads, 1).unsqueeze(1).to(device),
            value_index=value_index.to(device),
            value_offsets=(torch.arange(num_kv_heads * batch * groups) * context_len).to(device),
        )

    # ---- every layer -------------------------------------------------------------------------
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
        self._write_kv(k_cache, v_cache, metadata, k, v)
        decode, prefill = metadata.decode, metadata.prefill
        if isinstance(prefill, TokenQueries):  # the whole step in one op (csrc/decode_attention_rows.cpp)
            return torch.ops.tokenmill.decode_attention_rows.default(q, k_cache, v_cache, prefill.block_table,
                                                                      prefill.seq_lens, scale)
        if decode is not None and decode.covers_batch:  # a pure decode step: no scatter into `out`
            return self._decode(q, k_cache, v_cache, decode, scale)
        out = q.new_empty(metadata.num_tokens, num_heads * head_dim)
        if decode is not None:
            out[decode.token_index] = self._decode(q[decode.token_index], k_cache, v_cache, decode, scale)
        if prefill is not None:
            self._prefill_into(out, q, k_cache, v_cache, prefill, scale)
        if metadata.fresh_prefills:
            self._prefill_fresh(q, as_cached(k, k_cache), as_cached(v, v_cache), metadata.fresh_prefills, scale, out)
        return out

    def _prefill_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[tuple[int, int]],
                       scale: float, out: torch.Tensor) -> None:
        """Chunks with nothing cached attend to their own keys and values, causally, one SDPA call
        each: no gather from the cache, no padding to the longest chunk, no mask tensor."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        if prefill_kernel_applies(q.device, q.dtype, head_dim):
            starts, lengths = torch.tensor(chunks, dtype=torch.int64).view(-1, 2).unbind(1)
            torch.ops.tokenmill.prefill_attention_.default(out, q, k, v, starts, lengths, scale)
            return
        for start, length in chunks:
            rows = slice(start, start + length)
            attn = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1])  # [1, heads, length, head_dim]
            out[rows] = attn[0].transpose(0, 1).reshape(length, num_heads * head_dim)

    def _write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        if k.device.type == "cpu" and _rows_kernel_available():  # one op (csrc/decode_attention_rows.cpp)
            torch.ops.tokenmill.write_kv_rows.default(k, v, k_cache, v_cache, metadata.write_index)
        else:
            write_kv(k_cache, v_cache, metadata.write_index, k, v)

    def _gather_keys(self, k_cache: torch.Tensor, gather_index: torch.Tensor, context_len: int) -> torch.Tensor:
        """The blocks of gather_index as keys [kv_heads, B, context_len, head_dim] (a workspace view,
        in the cache's dtype)."""
        num_kv_heads, num_blocks, _, head_dim = k_cache.shape
        keys = self._gather(k_cache.view(num_kv_heads * num_blocks, -1), gather_index)
        return keys.view(num_kv_heads, -1, context_len, head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket,
                scale: float) -> torch.Tensor:
        """q: [B, num_heads, head_dim], one query per sequence -> [B, num_heads * head_dim]."""
        if bucket.gather_index is None:  # the CPU op's bucket: one op (csrc/decode_attention_rows.cpp)
            return torch.ops.tokenmill.decode_attention_rows.default(q, k_cache, v_cache, bucket.block_table,
                                                                      bucket.seq_lens, scale)
        num_kv_heads, _, _, head_dim = k_cache.shape
        batch, groups = q.shape[0], q.shape[1] // num_kv_heads
        queries = q.view(batch, num_kv_heads, groups, head_dim).transpose(0, 1)
        queries = queries.reshape(num_kv_heads * batch, groups, head_dim)  # [kv_heads * B, groups, head_dim]
        keys = self._gather_keys(k_cache, bucket.gather_index, bucket.context_len).to(q.dtype)
        keys = keys.view(num_kv_heads * batch, bucket.context_len, head_dim)
        scores = torch.baddbmm(bucket.attn_mask, queries, keys.transpose(1, 2), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        if v_cache.dtype == q.dtype:
            # probs @ values without gathering the values: a weighted sum of cache rows per bag
            attn = F.embedding_bag(bucket.value_index, v_cache.view(-1, head_dim), bucket.value_offsets,
                                   mode="sum", per_sample_weights=probs.view(-1))  # [kv_heads * B * groups, head_dim]
        else:  # a narrower pool: gather the values and widen them
            num_blocks = v_cache.shape[1]
            values = self._gather(v_cache.view(num_kv_heads * num_blocks, -1), bucket.gather_index, slot=1).to(q.dtype)
            attn = torch.bmm(probs, values.view(num_kv_heads * batch, bucket.context_len, head_dim))
        return attn.view(num_kv_heads, batch, groups * head_dim).transpose(0, 1).reshape(batch, -1)

    def _prefill_into(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      bucket: PrefillBucket, scale: float) -> None:
        out[bucket.token_index] = self._prefill(q, k_cache, v_cache, bucket, scale)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: PrefillBucket,
                 scale: float) -> torch.Tensor:
        """Queries of the bucket's chunks (taken from the flat q) -> [num_valid, num_heads * head_dim]."""
        num_kv_heads, num_blocks, _, head_dim = k_cache.shape
        batch, max_q = bucket.query_index.shape
        num_heads = q.shape[1]
        groups = num_heads // num_kv_heads
        # keys/values: [kv_heads, B, L, head_dim], contiguous
        shape = (num_kv_heads, batch, bucket.context_len, head_dim)
        keys = self._gather_keys(k_cache, bucket.gather_index, bucket.context_len).to(q.dtype)
        values = self._gather(v_cache.view(num_kv_heads * num_blocks, -1), bucket.gather_index, slot=1).view(shape)
        values = values.to(q.dtype)
        # queries: [kv_heads, B, Q * groups, head_dim]; SDPA sees kv_heads as batch, B as heads
        queries = q[bucket.query_index].view(batch, max_q, num_kv_heads, groups, head_dim)
        queries = queries.permute(2, 0, 1, 3, 4).reshape(num_kv_heads, batch, max_q * groups, head_dim)
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bucket.attn_mask, scale=scale)
        attn = attn.view(num_kv_heads, batch, max_q, groups, head_dim).permute(1, 2, 0, 3, 4)
        return attn.reshape(batch, max_q, num_heads * head_dim)[bucket.valid]


def rows_kernel_applies(geometry: CacheGeometry) -> bool:
    """Whether TorchPagedAttention's steps attend through decode_attention_rows (the AVX2 build's
    CPUs), which takes up to 8 query heads per kv head; other models take the PyTorch path."""
    return geometry.device.type == "cpu" and geometry.num_query_groups <= ROWS_MAX_QUERY_GROUPS and _rows_kernel_available()


def prefill_kernel_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt chunks attend through csrc/prefill_attention.cpp (fresh ones here, those after
    cached tokens in cpu_attention.py): bf16 on AVX-512 CPUs, head_dim a multiple of 32."""
    return device.type == "cpu" and dtype == torch.bfloat16 and head_dim % 32 == 0 and _prefill_kernel_available()


def narrow_pool_reads_in_one_kernel(device: torch.device) -> bool:
    """Whether decode here reads a 16-bit pool under float32 queries in one op, at float32's speed
    (the AVX2 build's decode_attention_rows): the engine then keeps float16 for a float32 model
    whose dtype it chose. Elsewhere (the AVX-512 build's paged kernels want the model's dtype) the
    PyTorch path would read it: asked for, not chosen."""
    return device.type == "cpu" and _rows_kernel_available()


# names of this module's own, for tests to switch the kernels off
_rows_kernel_available = decode_attention_rows_available
_prefill_kernel_available = prefill_attention_available


@dataclass
class AttentionContext:
    """Handed to the model for one forward: which backend, the step metadata, each layer's cache."""

    backend: AttentionBackend
    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]

    def attend(self, layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer_index]
        return self.backend.forward(q, k, v, k_cache, v_cache, self.metadata, scale)
