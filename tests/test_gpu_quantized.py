"""Quantized linears for devices without our kernels (layers/gpu_quantized.py), checked on the CPU
through torch's CPU twin of the int4 op; tests/test_cuda.py checks the CUDA packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.gpu_quantized import (
    INT4_MAX_ROWS, DequantizedLinear, Int4TinyGemmLinear, prepare_quantized_linears, tinygemm_available,
    tinygemm_inner_k_tiles,
)
from tokenmill.layers.quantized import QuantizedLinear, QuantizedWeight, quantize_rtn

CPU = torch.device("cpu")
needs_cpu_tinygemm = pytest.mark.skipif(not tinygemm_available(CPU), reason="this torch has no CPU int4 matmul")


def random_weight(rows: int, cols: int, group_size: int, symmetric: bool = False, seed: int = 0) -> QuantizedWeight:
    """4-bit codes with Q4_1-like scales and minimums (Q4_0-like: offset -8 s)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scales = torch.rand(rows, cols // group_size, generator=g) * 0.02 + 0.001
    offsets = -8 * scales if symmetric else -torch.rand(rows, cols // group_size, generator=g) * 0.2
    return QuantizedWeight.from_codes(u, scales, offsets, 4, group_size)


@needs_cpu_tinygemm
@pytest.mark.parametrize("rows", [1, 7, INT4_MAX_ROWS])
@pytest.mark.parametrize("group_size,cols,symmetric", [(32, 576, False), (64, 1536, True), (128, 384, False)])
def test_tinygemm_matches_the_dequantized_weight(rows, group_size, cols, symmetric):
    q = random_weight(48, cols, group_size, symmetric)
    bias = torch.randn(48).bfloat16()
    layer = Int4TinyGemmLinear(q, bias, tinygemm_inner_k_tiles(q))
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    reference = x.double() @ q.dequantize().double().T + bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 48)
    # scales and zeros held in bf16 (relative 2^-9 each) and a bf16 result
    assert (got.double() - reference).abs().max() <= 0.01 * reference.abs().max()


@needs_cpu_tinygemm
def test_many_rows_dequantize_for_the_dense_matmul():
    q = random_weight(16, 64, 32)
    layer = Int4TinyGemmLinear(q, None, tinygemm_inner_k_tiles(q))
    x = torch.randn(INT4_MAX_ROWS + 1, 64).bfloat16()
    assert torch.equal(layer(x), F.linear(x, q.dequantize(torch.bfloat16)))


def test_tinygemm_tiles_what_it_can_hold():
    assert tinygemm_inner_k_tiles(random_weight(16, 576, 32)) == 4  # 576 = 4 tiles x 16 x 9
    assert tinygemm_inner_k_tiles(random_weight(16, 1536, 32)) == 8
    assert tinygemm_inner_k_tiles(random_weight(16, 32, 32)) == 2
    assert tinygemm_inner_k_tiles(random_weight(24, 576, 32)) is None  # rows come in sixteens
    assert tinygemm_inner_k_tiles(random_weight(16, 96, 16)) is None  # Q6_K's 16-column groups
    assert tinygemm_inner_k_tiles(quantize_rtn(torch.randn(8, 64), 8, 32)) is None  # 8-bit


def test_prepare_sends_each_linear_its_way():
    int4, int8 = random_weight(16, 64, 32), quantize_rtn(torch.randn(16, 64), 8, 32)
    bias = torch.randn(16).bfloat16()
    model = nn.Sequential(QuantizedLinear(int4), QuantizedLinear(int8, bias), nn.Linear(64, 16))
    counts = prepare_quantized_linears(model, torch.bfloat16, CPU)
    if tinygemm_available(CPU):
        assert counts == {"int4 tinygemm": 1, "dense copy": 1}
        assert isinstance(model[0], QuantizedLinear) and isinstance(model[0].batched, Int4TinyGemmLinear)
    else:
        assert counts == {"int4 tinygemm": 0, "dense copy": 2} and isinstance(model[0], DequantizedLinear)
    assert isinstance(model[1], DequantizedLinear) and model[1].weight.dtype == torch.bfloat16  # codes dropped
    assert isinstance(model[2], nn.Linear)
    x = torch.randn(3, 64)
    assert torch.equal(model[1](x.bfloat16()), F.linear(x.bfloat16(), int8.dequantize(torch.bfloat16), bias))
    # float32 models get dense copies whatever the layout: tinygemm takes bf16 activations only
    model = nn.Sequential(QuantizedLinear(int4))
    assert prepare_quantized_linears(model, torch.float32, CPU) == {"int4 tinygemm": 0, "dense copy": 1}
    assert torch.allclose(model[0](x), x @ int4.dequantize().T, atol=1e-5)
