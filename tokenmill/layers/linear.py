"""CPU bf16 linear layers with oneDNN-packed weights.

oneDNN runs bf16 matmuls ~20% faster from its own blocked weight layout than from a plain
row-major weight, but for one activation row (single-stream decode) ATen's own matrix-vector
kernel (torch.mv, which never goes through oneDNN) is as fast or faster. CpuPackedLinear keeps
the two copies and picks per call. Applied by swapping modules after loading, so model code
stays plain nn.Linear.

A quantized linear (layers/quantized.py) gets only the packed copy, of its dequantized weight,
for batches: its few-row calls read the quantized codes, so no plain bf16 copy is kept; on CPUs
with AMX or AVX-512 BF16 its batches read the codes too, and it gets no copy at all.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.activation import silu_and_mul as fused_silu_and_mul
from tokenmill.layers.quantized import QuantizedLinear
from tokenmill.platform import cpu_flags

# At most this many rows go to ATen's matrix-vector kernel instead of oneDNN.
SMALL_BATCH_ROWS = 1


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bf16 weight packing, which needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: a bf16 model on
    an AVX2-only CPU keeps plain weights."""
    flags = cpu_flags()
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class CpuPackedLinear(nn.Module):
    """y = x @ W.T + b with W held plain (for one row) and oneDNN-packed (for more); without
    keep_plain, only packed (every call goes through oneDNN)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int = 64,
                 keep_plain: bool = True) -> None:
        super().__init__()
        self.weight = weight if keep_plain else None  # plain [out, in]; may be shared with a tied embedding
        self.bias = bias
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= SMALL_BATCH_ROWS and self.weight is not None:
            out = torch.mv(self.weight, x[0])
            return (out if self.bias is None else out + self.bias).unsqueeze(0)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class CpuPackedGateUp(CpuPackedLinear):
    """A gated MLP's fused [gate; up] projection, packed as two halves so that silu_and_mul runs
    inside oneDNN's GEMMs: SiLU as the gate GEMM's post-op, the product as the up GEMM's (both in
    float32, rounded once), with no separate passes over the two [tokens, intermediate] outputs."""

    def __init__(self, weight: torch.Tensor, batch_size_hint: int = 64, keep_plain: bool = True) -> None:
        nn.Module.__init__(self)
        self.weight, self.bias = weight if keep_plain else None, None
        half = weight.shape[0] // 2
        self.packed_gate = torch.ops.mkldnn._reorder_linear_weight(weight[:half].contiguous(), batch_size_hint)
        self.packed_up = torch.ops.mkldnn._reorder_linear_weight(weight[half:].contiguous(), batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the plain projection, for any other caller
        if x.shape[0] <= SMALL_BATCH_ROWS and self.weight is not None:
            return super().forward(x)
        return torch.cat([torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                          for w in (self.packed_gate, self.packed_up)], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= SMALL_BATCH_ROWS and self.weight is not None:
            return _plain_silu_and_mul(self, x)
        gate = torch.ops.mkldnn._linear_pointwise(x, self.packed_gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, gate, self.packed_up, None, "mul")


def silu_and_mul(gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate.T) * (x @ W_up.T) for a fused [gate; up] projection module (fused into the
    GEMMs where the module can)."""
    if isinstance(gate_up, (CpuPackedGateUp, QuantizedLinear)):
        return gate_up.silu_and_mul(x)
    return _plain_silu_and_mul(gate_up, x)


def _plain_silu_and_mul(gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return fused_silu_and_mul(gate_up(x))


def _packed(weight: torch.Tensor, bias: torch.Tensor | None, is_gate_up: bool, keep_plain: bool) -> CpuPackedLinear:
    if is_gate_up and bias is None:
        return CpuPackedGateUp(weight, keep_plain=keep_plain)
    return CpuPackedLinear(weight, bias, keep_plain=keep_plain)


def pack_linear_weights(model: nn.Module, quantized_too: bool = True) -> int:
    """Replace every nn.Linear of the model by a CpuPackedLinear (CpuPackedGateUp for the fused
    gate/up projections, named gate_up_proj), and (quantized_too) give every QuantizedLinear a
    packed copy of its dequantized weight for batches; returns the extra bytes used."""
    extra = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                bias = None if child.bias is None else child.bias.data
                setattr(parent, name, _packed(child.weight.data, bias, name == "gate_up_proj", keep_plain=True))
                extra += child.weight.numel() * child.weight.element_size()
            elif isinstance(child, QuantizedLinear) and quantized_too:
                weight = child.qweight.dequantize(torch.bfloat16)
                child.batched = _packed(weight, child.bias, name == "gate_up_proj", keep_plain=False)
                extra += weight.numel() * weight.element_size()
    return extra


def linear_weight_bytes(model: nn.Module, quantized_too: bool = True) -> int:
    """What pack_linear_weights would add: a bf16 copy of every linear's weight."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, QuantizedLinear) and quantized_too:
            total += m.out_features * m.in_features * 2
    return total
