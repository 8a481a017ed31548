"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = w * x / rms(x); the statistic is taken in float32 whatever the dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f32 = x.float()
        variance = x_f32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x_f32 * torch.rsqrt(variance + self.eps)).to(x.dtype)
