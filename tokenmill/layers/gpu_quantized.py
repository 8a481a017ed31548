"""Quantized linears where our CPU kernels do not run (CUDA).

4-bit weights of a bfloat16 model multiply through torch's int4 "tinygemm"
(`_weight_int4pack_mm`): the codes are repacked once at load into its tiled layout, and each
group's scale s and offset o become a bf16 (scale, zero) pair with w = (u - 8) * s + zero, so
zero = o + 8 s. The weights stay 4-bit in GPU memory and a decode row reads a quarter of bf16's
bytes, in one kernel per linear (dequantizing per call takes ~8, which a launch-bound decode step
cannot afford). Batches of more than INT4_MAX_ROWS rows (prefill) dequantize the weight per call
for cuBLAS instead. Every other layout (8-bit, 16-column groups, shapes tinygemm cannot tile), and
every linear of a float16/float32 model, is replaced at load by a dense copy of its dequantized
weight: as fast as an unquantized model, in its memory.

The same module runs on the CPU through torch's CPU twin of the op (`_for_cpu`), which is how
the CPU tests check the scale/zero mapping; on CPUs our own kernels (layers/quantized.py) serve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.quantized import QuantizedLinear, QuantizedWeight

INT4_MAX_ROWS = 64  # more rows dequantize for cuBLAS (tinygemm is built for few rows)
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)


def tinygemm_inner_k_tiles(qweight: QuantizedWeight) -> int | None:
    """The tinygemm tiling that fits the weight (the largest of 8, 4, 2 dividing K into tiles of
    16 columns; output rows in sixteens, as the CPU twin wants), or None where it cannot hold it."""
    rows, cols = qweight.shape
    if qweight.bits != 4 or qweight.group_size not in TINYGEMM_GROUP_SIZES or rows % 16:
        return None
    return next((tiles for tiles in (8, 4, 2) if cols % (16 * tiles) == 0), None)


def tinygemm_available(device: torch.device) -> bool:
    """Whether torch's int4 weight-only matmul runs on this device (CUDA: Ampere or newer)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0) and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4TinyGemmLinear(nn.Module):
    """y = x @ W.T + b for a 4-bit QuantizedWeight, through tinygemm (bf16 activations)."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None, inner_k_tiles: int) -> None:
        super().__init__()
        self.qweight, self.bias, self.group_size = qweight, bias, qweight.group_size
        u = qweight.unpacked_codes()  # [N, K] uint8, 0..15
        if u.device.type == "cuda":  # two codes a byte, the even column in the high nibble
            pairs = ((u[:, ::2] << 4) | u[:, 1::2]).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32), inner_k_tiles)
        scales = qweight.scales.float()
        zeros = qweight.offsets.float() + 8 * scales
        # [K / G, N, 2]: per group and output row, (scale, zero)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] bf16
        if x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x, self.qweight.dequantize(x.dtype), self.bias)
        matmul = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        out = matmul(x.contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return out if self.bias is None else out + self.bias


class DequantizedLinear(nn.Module):
    """y = x @ W.T + b from a dense copy of the dequantized weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def prepare_quantized_linears(model: nn.Module, dtype: torch.dtype, device: torch.device) -> dict[str, int]:
    """For a device without our kernels: give every QuantizedLinear whose weight tinygemm holds an
    Int4TinyGemmLinear as its batched module, and swap every other one for a DequantizedLinear
    (its codes are then freed, unless a quantized embedding shares them). Returns how many linears
    went each way."""
    counts = {"int4 tinygemm": 0, "dense copy": 0}
    tinygemm = dtype == torch.bfloat16 and tinygemm_available(device)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, QuantizedLinear) or not isinstance(child.qweight, QuantizedWeight):
                continue
            tiles = tinygemm_inner_k_tiles(child.qweight) if tinygemm else None
            if tiles is not None:
                child.batched = Int4TinyGemmLinear(child.qweight, child.bias, tiles)
                counts["int4 tinygemm"] += 1
            else:
                setattr(parent, name, DequantizedLinear(child.qweight.dequantize(dtype), child.bias))
                counts["dense copy"] += 1
    return counts
