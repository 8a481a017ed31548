"""GGUF quantized tensors repacked, without loss, into the layout of layers/quantized.py.

Each block type of llama.cpp (ggml-common.h) becomes unsigned codes u with per-group scales s
and offsets o (w = s u + o):

  Q4_0  32-blocks: fp16 d, 16 bytes (element j low nibble, j + 16 high)   w = d (q - 8)
  Q4_1  32-blocks: fp16 d, fp16 m, 16 bytes as Q4_0                       w = d q + m
  Q8_0  32-blocks: fp16 d, int8 q[32]                                     w = d q       (u = q + 128)
  Q4_K  256-blocks: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
        128 bytes: chunk c of 64 elements = bytes 32c..32c+31, sub-block 2c low nibbles, 2c+1 high
                                                                          w = d sc q - dmin mn
  Q5_K  as Q4_K plus qh[32]: bit 2c (2c + 1) of qh[l] adds 16 to element l of sub-block 2c (2c + 1)
  Q6_K  256-blocks: ql[128], qh[64], int8 scales[16] (one per 16), fp16 d; in half h of 128, for
        l < 32 the elements l, l+32, l+64, l+96 take ql[l] low, ql[l+32] low, ql[l] high,
        ql[l+32] high and qh[l] bits 0-1, 2-3, 4-5, 6-7 as their top two bits   w = d sc (q - 32)
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.layers.quantized import QuantizedWeight, compact_scales, regroup_nibbles

QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of a K-quant super-block's 8 sub-blocks, from its 12 bytes."""
    s = packed.astype(np.int32)
    scale_low, min_low = s[..., 0:4] & 63, s[..., 4:8] & 63
    scale_high = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    min_high = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([scale_low, scale_high], -1), np.concatenate([min_low, min_high], -1)


def _q4_codes(qs: np.ndarray) -> torch.Tensor:
    """Q4_0 / Q4_1 nibbles ([rows, blocks, 16]: byte j holds element j low, j + 16 high) in our
    4-bit row layout (64-column chunks, byte j holding column j low and j + 32 high; a last chunk
    of 32 columns is a GGUF block as it is), byte to byte without unpacking."""
    q = torch.from_numpy(np.ascontiguousarray(qs))
    rows, blocks, _ = q.shape
    pairs = blocks // 2
    codes = regroup_nibbles(q[:, : 2 * pairs].reshape(rows, pairs, 32)).reshape(rows, -1)  # blocks 2c, 2c+1: chunk c
    return torch.cat([codes, q[:, -1]], dim=1) if blocks % 2 else codes


def repack(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw bytes ([rows, bytes per row]) as a QuantizedWeight of `shape` [N, K]."""
    rows, cols = shape
    b = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):  # byte to byte: these were most of a start-up's repacking
        size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
        blocks = b.reshape(rows, -1, size)
        scales = torch.from_numpy(_f16(blocks[..., 0:2]))
        if type_name == "Q8_0":
            codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).reshape(rows, cols)) ^ 0x80  # q + 128
            offsets = -128 * scales
        else:
            codes = _q4_codes(blocks[..., size - 16 :])
            offsets = -8 * scales if type_name == "Q4_0" else torch.from_numpy(_f16(blocks[..., 2:4]))
        scales, offsets = compact_scales(scales, offsets)
        return QuantizedWeight(codes, scales, offsets, 4 if size < 34 else 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        blocks = b.reshape(rows, -1, size)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., size - 128:].reshape(rows, -1, 4, 32)
        u = np.stack([qs & 0xF, qs >> 4], 3)  # [rows, blocks, chunk, low/high, 32]
        if type_name == "Q5_K":
            qh = blocks[..., 16:48][:, :, None, None, :]
            bit = ((2 * np.arange(4))[:, None, None] + np.arange(2)[None, :, None]).astype(np.uint8)
            u = u + ((qh >> bit) & 1) * 16
        scales = d[..., None] * sc  # [rows, blocks, 8]
        offsets = -(dmin[..., None] * mn)
        bits, group = (4 if type_name == "Q4_K" else 8), 32
    elif type_name == "Q6_K":
        blocks = b.reshape(rows, -1, 210)
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 64)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)
        low = [ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4]
        u = np.stack([low[i] | (((qh >> (2 * i)) & 3) << 4) for i in range(4)], 3)
        scales = _f16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].view(np.int8).astype(np.float32)
        offsets = -32 * scales
        bits, group = 8, 16
    else:
        raise ValueError(f"{type_name} is not a quantized type we repack")
    u = torch.from_numpy(np.ascontiguousarray(u.reshape(rows, cols).astype(np.uint8)))
    scales = torch.from_numpy(np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32))
    offsets = torch.from_numpy(np.ascontiguousarray(offsets.reshape(rows, -1), dtype=np.float32))
    return QuantizedWeight.from_codes(u, scales, offsets, bits, group)
