"""RMSNorm, with the statistic always taken in float32, and the residual add fused in."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.layers.cpu_kernels import fused_ops_available


class RMSNorm(nn.Module):
    """y = w * x / rms(x); with a residual, residual += x first (in place) and y = w * residual / rms.

    On the CPU with our kernels (csrc/fused_ops.cpp) either is one op. The PyTorch path takes the
    sum of squares from torch.linalg.vector_norm with float32 accumulation: on CPU it is ~10x
    faster than pow().mean() (or F.rms_norm) over the short rows of an LLM, and it never
    materialises an upcast copy of x. Products are formed in float32 and rounded once. Elsewhere
    (CUDA) torch.rms_norm, which is one fused kernel there, computing the same in float32.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.device.type == "cpu" and x.dim() == 2 and _fused_available():
            if residual is None:
                return torch.ops.tokenmill.rms_norm.default(x, self.weight, self.eps)
            return torch.ops.tokenmill.add_rms_norm_.default(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        if x.device.type != "cpu":  # one fused kernel on CUDA (a step captured in a graph is ~30 kernels a layer)
            return torch.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(self.eps))  # [..., 1] float32
        return torch.mul(x, inv_rms).mul_(self.weight).to(x.dtype)


_fused_available = fused_ops_available  # a name of this module's own, for tests to switch off
