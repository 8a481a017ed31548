"""oneDNN-packed bf16 linears against plain float32 math on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import (
    CpuPackedGateUp,
    CpuPackedLinear,
    pack_linear_weights,
    packing_available,
    silu_and_mul,
)

pytestmark = pytest.mark.skipif(not packing_available(torch.device("cpu"), torch.bfloat16),
                                reason="this torch build has no oneDNN bf16 linear")


def _weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 64])  # ATen's GEMV for one row, oneDNN above
def test_packed_linear_matches_float32(num_rows):
    weight, bias = _weights(96, 64), _weights(1, 96, seed=1)[0]
    x = _weights(num_rows, 64, seed=2) * 20
    out = CpuPackedLinear(weight, bias)(x)
    expected = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (num_rows, 96)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("num_rows", [1, 2, 5, 64])
def test_gate_up_silu_and_mul_matches_float32(num_rows):
    weight = _weights(2 * 80, 64)
    x = _weights(num_rows, 64, seed=3) * 20
    packed = CpuPackedGateUp(weight)
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(packed, x).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
    # called as a plain module it is still the [gate; up] projection
    torch.testing.assert_close(packed(x).float(), F.linear(x.float(), weight.float()), atol=2e-2, rtol=1e-2)


def test_pack_linear_weights_swaps_modules():
    mlp = nn.Module()
    mlp.gate_up_proj = nn.Linear(64, 160, bias=False, dtype=torch.bfloat16)
    mlp.down_proj = nn.Linear(80, 64, bias=False, dtype=torch.bfloat16)
    extra = pack_linear_weights(mlp)
    assert isinstance(mlp.gate_up_proj, CpuPackedGateUp) and type(mlp.down_proj) is CpuPackedLinear
    assert extra == (64 * 160 + 80 * 64) * 2


@pytest.mark.parametrize("num_rows", [1, 8, 9, 64])  # the quantized kernel up to 8 rows, the packed copy above
def test_quantized_layers_get_a_packed_copy_for_batches(num_rows):
    from tokenmill.layers.quantized import QuantizedLinear, quantize_rtn

    mlp = nn.Module()
    mlp.gate_up_proj = QuantizedLinear(quantize_rtn(_weights(160, 64).float(), 4))
    mlp.down_proj = QuantizedLinear(quantize_rtn(_weights(64, 96, seed=1).float(), 8))
    extra = pack_linear_weights(mlp)
    assert extra == (160 * 64 + 64 * 96) * 2
    assert isinstance(mlp.gate_up_proj.batched, CpuPackedGateUp) and mlp.gate_up_proj.batched.weight is None
    assert type(mlp.down_proj.batched) is CpuPackedLinear and mlp.down_proj.batched.weight is None
    x = _weights(num_rows, 64, seed=2) * 20
    gate, up = F.linear(x.float(), mlp.gate_up_proj.qweight.dequantize()).chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(mlp.gate_up_proj, x).float(), F.silu(gate) * up, atol=3e-2, rtol=2e-2)
    y = _weights(num_rows, 96, seed=3) * 20
    torch.testing.assert_close(mlp.down_proj(y).float(), F.linear(y.float(), mlp.down_proj.qweight.dequantize()),
                               atol=3e-2, rtol=2e-2)
