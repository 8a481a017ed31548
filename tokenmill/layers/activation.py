"""The gated MLP's activation: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_kernels import fused_ops_available


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] (one op on the CPU with our kernels)."""
    if gate_up.device.type == "cpu" and gate_up.dim() == 2 and _fused_available():
        return torch.ops.tokenmill.silu_and_mul.default(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_fused_available = fused_ops_available  # a name of this module's own, for tests to switch off
