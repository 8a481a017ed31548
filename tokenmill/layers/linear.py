"""CPU bf16 linear layers with oneDNN-packed weights.

oneDNN runs bf16 matmuls ~20% faster from its own blocked weight layout than from a plain
row-major weight, but for one or two activation rows (single-stream decode) ATen's own
matrix-vector kernel beats both by ~2x. CpuPackedLinear keeps the two copies and picks per
call. Applied by swapping modules after loading, so model code stays plain nn.Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# At most this many rows go to ATen's matrix-vector kernel instead of oneDNN.
SMALL_BATCH_ROWS = 2


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class CpuPackedLinear(nn.Module):
    """y = x @ W.T + b with W held plain (for 1-2 rows) and oneDNN-packed (for more)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, batch_size_hint: int = 64) -> None:
        super().__init__()
        self.weight = weight  # plain [out, in]; may be shared with a tied embedding
        self.bias = bias
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= SMALL_BATCH_ROWS:
            previous = torch.backends.mkldnn.enabled
            torch.backends.mkldnn.enabled = False  # route to ATen's own GEMV
            try:
                return F.linear(x, self.weight, self.bias)
            finally:
                torch.backends.mkldnn.enabled = previous
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every nn.Linear of the model by a CpuPackedLinear; returns the extra bytes used."""
    extra = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, CpuPackedLinear(child.weight.data, None if child.bias is None else child.bias.data))
                extra += child.weight.numel() * child.weight.element_size()
    return extra


def linear_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
