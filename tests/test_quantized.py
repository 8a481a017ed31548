"""Quantized weights: the layout, the kernel against a float64 reference, GGUF repacking against the
gguf package's own dequantizer, and models that keep their weights quantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.layers import quantized
from tokenmill.layers.cpu_kernels import (
    kernels_available, quant_gemm_available, quant_gemv_available, quant_gemv_i8_available, quant_gemv_q8_available,
)
from tokenmill.layers.quantized import (
    InterleavedWeight, QuantizedEmbedding, QuantizedLinear, QuantizedWeight, concat_rows, interleave_weights,
    pack_nibbles, quantize_rtn, quantized_matmul, unpack_nibbles,
)
from tokenmill.models.gguf_quants import QUANTIZED_TYPES, repack

needs_kernel = pytest.mark.skipif(not quant_gemv_available(), reason="the quantized kernel needs AVX-512 or AVX2")
needs_q8_kernel = pytest.mark.skipif(not quant_gemv_q8_available(), reason="8-bit activations need AVX-512 VNNI")
needs_i8_kernel = pytest.mark.skipif(not quant_gemv_i8_available(), reason="quant_gemv_i8 is the AVX2 build's")


def gemm_backends() -> list[int]:
    """quant_gemm's backends this CPU runs: 1 (AVX-512 BF16), and 0 (the best: AMX) where that differs."""
    if not kernels_available():
        return []
    have = torch.ops.tokenmill.quant_gemm_backends()
    return {0: [], 1: [1], 2: [0, 1]}[have]


def random_weight(rows: int, cols: int, bits: int, group: int, seed: int = 0, half: bool = False) -> QuantizedWeight:
    """Random codes, scales and offsets; with half, scales and offsets that float16 holds exactly."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 1 << bits, (rows, cols), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, cols // group, generator=gen) * 0.02 + 0.001
    offsets = -scales * (1 << (bits - 1)) + torch.randn(rows, cols // group, generator=gen) * 0.01
    if half:
        scales, offsets = scales.half().float(), offsets.half().float()
    q = QuantizedWeight.from_codes(u, scales, offsets, bits, group)
    assert q.scales.dtype == (torch.float16 if half else torch.float32)
    return q


def reference_weight(q: QuantizedWeight) -> torch.Tensor:
    """float64 weights from the unpacked codes, computed independently of QuantizedWeight.dequantize."""
    u = q.unpacked_codes().double()
    scale = q.scales.double().repeat_interleave(q.group_size, dim=1)
    offset = q.offsets.double().repeat_interleave(q.group_size, dim=1)
    return u * scale + offset


@pytest.mark.parametrize("cols", [32, 64, 96, 576, 1536])
def test_nibble_packing_round_trips_with_the_documented_byte_order(cols):
    u = torch.randint(0, 16, (3, cols), dtype=torch.uint8)
    packed = pack_nibbles(u)
    assert packed.shape == (3, cols // 2)
    assert torch.equal(unpack_nibbles(packed, cols), u)
    if cols >= 64:  # byte j of the first chunk: column j low, column j + 32 high
        assert int(packed[0, 5]) == int(u[0, 5]) | int(u[0, 37]) << 4
    if cols % 64:  # the 32-column tail: column j low, j + 16 high
        tail = cols - 32
        assert int(packed[1, tail // 2 + 3]) == int(u[1, tail + 3]) | int(u[1, tail + 19]) << 4


def layouts(pairs):
    """(bits, group, cols) for the widths (with and without a 32-column tail) each group divides."""
    return [(bits, group, cols) for bits, group in pairs for cols in (32, 96, 576, 1536) if cols % group == 0]


@needs_kernel
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 16), (4, 16), (8, 64)]))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("half", [False, True])
def test_kernel_matches_float64_reference(bits, group, cols, rows, half):
    q = random_weight(45, cols, bits, group, seed=cols + rows, half=half)  # 45 outputs: not a multiple of the split
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ reference_weight(q).T
    got = torch.ops.tokenmill.quant_gemv(x, q.codes, q.scales, q.offsets, q.bits, q.group_size)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_takes_half_precision_activations(dtype):
    q = random_weight(64, 576, 4, 32)
    x = torch.randn(3, 576).to(dtype)
    got = torch.ops.tokenmill.quant_gemv(x, q.codes, q.scales, q.offsets, 4, 32)
    want = x.double() @ reference_weight(q).T  # the kernel accumulates in float32, rounds once
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 16), (4, 16), (8, 64)]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_kernel_matches_the_float64_weights(bits, group, cols, dtype, monkeypatch):
    q = random_weight(19, cols, bits, group, seed=cols, half=dtype != torch.float32)
    got = q.dequantize(dtype)
    assert got.dtype == dtype and got.shape == (19, cols)
    want = reference_weight(q)
    torch.testing.assert_close(got.double(), want, rtol=1e-6 if dtype == torch.float32 else 2**-8, atol=1e-7)
    monkeypatch.setattr(quantized, "_kernel_available", lambda: False)  # the PyTorch path: the same values
    torch.testing.assert_close(q.dequantize(dtype), got, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 16), (4, 16), (4, 64)])
@pytest.mark.parametrize("num_rows", [1, 16, 45])
def test_interleaved_layout_round_trips_with_the_documented_byte_order(bits, group, num_rows):
    q = random_weight(num_rows, 128, bits, group, seed=num_rows)
    w = InterleavedWeight.from_rows(q)
    blocks, groups = -(-num_rows // 16), 128 // group
    assert w.codes.shape == (blocks, groups, 16 * group * bits // 8) and w.scales.shape == (blocks, groups, 16)
    u = q.unpacked_codes()
    row, g, col = num_rows - 1, groups - 1, 5  # last row, last group; column 5 = quad 1, byte 1
    block, lane = divmod(row, 16)
    byte = w.codes[block, g, 64 * 1 + 4 * lane + 1]
    if bits == 8:
        assert int(byte) == int(u[row, g * group + col])
    else:  # quad j in the low nibbles of vector j, quad j + G / 8 in the high ones
        assert int(byte) == int(u[row, g * group + col]) | int(u[row, g * group + col + group // 2]) << 4
    assert w.scales[block, g, lane] == q.scales[row, g]
    assert (w.codes[-1].view(groups, -1, 16, 4)[:, :, num_rows % 16 or 16:] == 0).all()  # padding rows are zero
    back = w.to_rows()
    assert torch.equal(back.codes, q.codes) and torch.equal(back.scales, q.scales) and torch.equal(back.offsets, q.offsets)
    ids = torch.tensor([row, 0, row // 2])
    torch.testing.assert_close(w.rows(ids).dequantize(), q.dequantize()[ids], rtol=0, atol=0)
    assert w.shape == q.shape


def activation_rounding_bound(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    """[M, N]: the most that rounding x to 8 bits per group can move x @ W.T in quant_gemv_q8:
    sum over groups of |scale| * (max |x| / 127) / 2 * sum of the group's codes."""
    groups = x.shape[1] // q.group_size
    step = x.double().abs().view(x.shape[0], groups, q.group_size).amax(dim=-1) / 127  # [M, groups]
    code_sums = q.unpacked_codes().double().view(q.shape[0], groups, q.group_size).sum(dim=-1)  # [N, groups]
    return (step / 2) @ (q.scales.double().abs() * code_sums).T


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, q: QuantizedWeight, divisor: int) -> None:
    """got is x @ W.T up to the rounding of x to 8 bits per group (divided by `divisor` for finer
    roundings), float32 sums and, for a bf16 result, its own rounding; and x really was rounded."""
    want = x.double() @ reference_weight(q).T
    bound = activation_rounding_bound(x, q) / divisor + 1e-5 * (x.double().abs() @ reference_weight(q).abs().T)
    if got.dtype == torch.bfloat16:
        bound += want.abs() * 2**-8
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
    assert error.max() > 0  # the activations really were rounded: this is not the float32 kernel


def q8_matmul(x: torch.Tensor, q: QuantizedWeight, two_parts: bool) -> torch.Tensor:
    w = InterleavedWeight.from_rows(q)
    return torch.ops.tokenmill.quant_gemv_q8(x, w.codes, w.scales, w.offsets, w.bits, w.group_size, w.num_rows,
                                             two_parts)


@needs_q8_kernel
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 16), (4, 16), (8, 64), (4, 128)]))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_parts", [False, True], ids=["8-bit", "two 8-bit parts"])
def test_q8_kernel_within_its_activation_rounding(bits, group, cols, rows, dtype, two_parts):
    q = random_weight(45, cols, bits, group, seed=cols + rows, half=rows % 2 == 0)  # 45: a padded last block
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = q8_matmul(x, q, two_parts)
    assert got.dtype == dtype and got.shape == (rows, 45)
    if two_parts:
        assert_within_rounding(got, x, q, 254)  # the second part: in 254ths of a step
    else:  # one part: the product of x rounded as quant_gemm_q8 rounds it (offsets included)
        assert_is_the_rounded_product(got, x, q)


@needs_q8_kernel
def test_q8_kernel_refuses_a_row_layout():
    q = random_weight(32, 64, 4, 32)
    with pytest.raises(RuntimeError, match="codes must be"):
        torch.ops.tokenmill.quant_gemv_q8(torch.randn(1, 64), q.codes, q.scales, q.offsets, 4, 32, 32, True)


@needs_q8_kernel
def test_which_kernel_a_layer_takes(monkeypatch):
    """The row layout: the float kernel. Interleaved (bf16 models on VNNI CPUs): the VNNI kernel with
    two 8-bit parts by default, one where a layer asks for 8 bits, the float kernel for None or on a
    CPU without VNNI."""
    q = random_weight(64, 576, 4, 32)
    w = InterleavedWeight.from_rows(q)
    x = torch.randn(2, 576)
    exact = torch.ops.tokenmill.quant_gemv(x, q.codes, q.scales, q.offsets, 4, 32)
    assert torch.equal(quantized_matmul(x, q), exact)
    x16 = x.bfloat16()
    float_kernel = torch.ops.tokenmill.quant_gemv(x16, q.codes, q.scales, q.offsets, 4, 32)
    assert torch.equal(quantized_matmul(x16, q), float_kernel)
    for bits, two_parts in ((16, True), (8, False)):
        assert torch.equal(quantized_matmul(x16, w, bits), q8_matmul(x16, q, two_parts))
    assert torch.equal(QuantizedLinear(w)(x16), q8_matmul(x16, q, True))
    assert torch.equal(quantized_matmul(x16, w, None), float_kernel)
    monkeypatch.setattr(quantized, "_q8_kernel_available", lambda: False)  # a CPU without VNNI
    assert torch.equal(quantized_matmul(x16, w), float_kernel)


@needs_i8_kernel
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 64), (4, 128)]))
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_parts", [False, True], ids=["8-bit", "two 8-bit parts"])
def test_i8_kernel_within_its_activation_rounding(bits, group, cols, rows, dtype, two_parts):
    q = random_weight(45, cols, bits, group, seed=cols + rows, half=rows % 2 == 0)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = torch.ops.tokenmill.quant_gemv_i8(x, q.codes, q.scales, q.offsets, q.bits, q.group_size, two_parts)
    assert got.dtype == dtype and got.shape == (rows, 45)
    # the second part is in 256ths of a step, clamped to +-127 of them: at most 1/128 of the first's error
    assert_within_rounding(got, x, q, 128 if two_parts else 1)


@needs_i8_kernel
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 64), (4, 128)]))
@pytest.mark.parametrize("rows", [9, 16, 19, 67])
@pytest.mark.parametrize("two_parts", [False, True], ids=["8-bit", "two 8-bit parts"])
def test_i8_kernel_batches_are_each_row_alone(bits, group, cols, rows, two_parts):
    """The batched loop (more than 4 rows: tiles over blocks of output rows, a remainder the
    few-row way) gives every row bit for bit what it gives that row alone, within the rounding."""
    q = random_weight(83, cols, bits, group, seed=cols + rows, half=rows % 2 == 0)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    i8 = torch.ops.tokenmill.quant_gemv_i8
    got = i8(x, q.codes, q.scales, q.offsets, q.bits, q.group_size, two_parts)
    alone = torch.cat([i8(x[i : i + 1], q.codes, q.scales, q.offsets, q.bits, q.group_size, two_parts)
                       for i in range(rows)])
    assert torch.equal(got, alone)
    assert_within_rounding(got, x, q, 128 if two_parts else 1)


@needs_i8_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_i8_kernel_with_one_part_is_the_rounded_rows_product(bits, rows):
    """With one 8-bit part the whole weight s u + o meets the rounded row (its offsets the rounded
    group sums): the product is that of the rounded x, to float32 summation, not x's own."""
    q = random_weight(40, 256, bits, 32, seed=bits + rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    groups = x.view(rows, 8, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    rounded = (torch.round(groups * (127.0 / amax)) * (amax / 127.0)).view(rows, 256)  # float32, as the kernel
    want = rounded.double() @ reference_weight(q).T
    got = torch.ops.tokenmill.quant_gemv_i8(x, q.codes, q.scales, q.offsets, q.bits, q.group_size, False)
    assert (got.double() - want).abs().max() <= 1e-5 * (x.double().abs() @ reference_weight(q).abs().T).max()


@needs_i8_kernel
def test_i8_kernel_refuses_groups_of_16():
    q = random_weight(32, 64, 8, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tokenmill.quant_gemv_i8(torch.randn(1, 64), q.codes, q.scales, q.offsets, 8, 16, True)


@needs_i8_kernel
def test_which_kernel_a_layer_takes_on_avx2(monkeypatch):
    """Row layout on AVX2: quant_gemv_i8 with two 8-bit parts by default, one where a layer asks for
    8 bits, and the float kernel for None or groups of 16 columns (Q6_K)."""
    q, q16 = random_weight(64, 576, 4, 32), random_weight(64, 576, 8, 16)
    x = torch.randn(2, 576)
    i8 = torch.ops.tokenmill.quant_gemv_i8
    assert torch.equal(quantized_matmul(x, q), i8(x, q.codes, q.scales, q.offsets, 4, 32, True))
    assert torch.equal(quantized_matmul(x, q, 8), i8(x, q.codes, q.scales, q.offsets, 4, 32, False))
    exact = torch.ops.tokenmill.quant_gemv(x, q.codes, q.scales, q.offsets, 4, 32)
    assert torch.equal(quantized_matmul(x, q, None), exact)
    layer = QuantizedLinear(q)
    assert torch.equal(layer(x), i8(x, q.codes, q.scales, q.offsets, 4, 32, True))
    layer.activation_bits = None
    assert torch.equal(layer(x), exact)
    assert torch.equal(quantized_matmul(x, q16), torch.ops.tokenmill.quant_gemv(x, q16.codes, q16.scales, q16.offsets, 8, 16))


@needs_i8_kernel
def test_avx2_batches_up_to_64_rows_read_the_codes(monkeypatch):
    """Batches of up to I8_BATCH_MAX_ROWS rows round and multiply as few rows do (quant_gemv_i8);
    more rows (prefill chunks) multiply a dequantized float32 weight; a layer rounding to 8 bits
    sends every batch to quant_gemv_i8."""
    q = random_weight(80, 576, 4, 32)
    layer = QuantizedLinear(q)
    i8 = torch.ops.tokenmill.quant_gemv_i8
    for rows in (9, quantized.I8_BATCH_MAX_ROWS):
        x = torch.randn(rows, 576)
        assert torch.equal(layer(x), i8(x, q.codes, q.scales, q.offsets, 4, 32, True))
    x = torch.randn(quantized.I8_BATCH_MAX_ROWS + 1, 576)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, q.dequantize()))
    layer.activation_bits = 8
    assert torch.equal(layer(x), i8(x, q.codes, q.scales, q.offsets, 4, 32, False))
    monkeypatch.setattr(quantized, "_gemm_i8_kernel_available", lambda: False)  # TOKENMILL_INT8_GEMM=0
    x = torch.randn(9, 576)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, q.dequantize()))


def gemm(x: torch.Tensor, q: QuantizedWeight, backend: int) -> torch.Tensor:
    w = InterleavedWeight.from_rows(q)
    return torch.ops.tokenmill.quant_gemm(x, w.codes, w.scales, w.offsets, w.bits, w.group_size, w.num_rows, backend)


@pytest.mark.skipif(not gemm_backends(), reason="quant_gemm needs AVX-512 BF16")
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 16), (4, 16), (8, 64), (4, 128)]))
@pytest.mark.parametrize("rows", [1, 9, 16, 17, 33, 64, 129])
@pytest.mark.parametrize("outputs", [45, 96])  # a padded last block; an odd number of blocks (6) and 3 pairs
def test_gemm_kernel_equals_the_bf16_weights_product(bits, group, cols, rows, outputs):
    """Many bf16 rows: the product with the weight dequantized in float32 and rounded to bf16
    (what the kernel puts in its panels), summed in float32, rounded once to bf16."""
    q = random_weight(outputs, cols, bits, group, seed=cols + rows, half=rows % 2 == 0)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
    w = reference_weight(q).float().bfloat16().double()
    want = x.double() @ w.T
    bound = want.abs() * 2**-8 + 1e-5 * (x.double().abs() @ w.abs().T)  # the output's rounding, float32 sums
    for backend in gemm_backends():
        got = gemm(x, q, backend)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
        error = (got.double() - want).abs()
        assert (error <= bound).all(), f"backend {backend}: worst excess {(error - bound).max().item():.3g}"


@pytest.mark.skipif(not gemm_backends(), reason="quant_gemm needs AVX-512 BF16")
@pytest.mark.parametrize("name", ["quant_gemm", "quant_gemm_q8"])
def test_gemm_kernels_refuse_what_they_cannot_take(name):
    if name == "quant_gemm_q8" and not quant_gemv_q8_available():
        pytest.skip("quant_gemm_q8 needs AVX-512 VNNI")
    op = getattr(torch.ops.tokenmill, name)
    q = InterleavedWeight.from_rows(random_weight(32, 64, 4, 32))
    args = (q.codes, q.scales, q.offsets, 4, 32, 32)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.randn(9, 64), *args)
    with pytest.raises(RuntimeError, match="codes must be"):
        op(torch.randn(9, 128).bfloat16(), *args)
    if name == "quant_gemm":
        with pytest.raises(RuntimeError, match="backend"):
            op(torch.randn(9, 64).bfloat16(), *args, 3)


needs_gemm_q8 = pytest.mark.skipif(not quant_gemv_q8_available(), reason="quant_gemm_q8 needs AVX-512 VNNI")


def rounded_to_8_bits(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as quant_gemm_q8 rounds it, in float64: per group of columns, d = max |x| / 127 and
    round(x * (127 / max |x|)) (float32, to nearest even) times d."""
    rows = x.shape[0]
    x32 = x.float().view(rows, -1, group)
    top = x32.abs().amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0)  # (127.0 / top is 127 * (1 / top))
    return (torch.round(x32 * inverse).double() * (top / 127.0).double()).view(rows, -1)


@needs_gemm_q8
@pytest.mark.parametrize("bits,group,cols", layouts([(4, 32), (8, 32), (8, 16), (4, 16), (8, 64), (4, 128)]))
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 13, 64, 129])
@pytest.mark.parametrize("outputs", [45, 96])  # a padded last block; an odd number of blocks (6) and 3 pairs
def test_gemm_q8_kernel_equals_the_product_with_rows_rounded_to_8_bits(bits, group, cols, rows, outputs):
    """Many bf16 rows through vpdpbusd: exactly the float64 product of the weight with x rounded to
    8 bits per group (offsets included: they meet the rounded rows), up to float32 sums and the
    output's bf16 rounding; and within that rounding's own bound of the exact product."""
    q = random_weight(outputs, cols, bits, group, seed=cols + rows, half=rows % 2 == 0)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).bfloat16()
    w = InterleavedWeight.from_rows(q)
    got = torch.ops.tokenmill.quant_gemm_q8(x, w.codes, w.scales, w.offsets, bits, group, outputs)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    assert_is_the_rounded_product(got, x, q)


def assert_is_the_rounded_product(got: torch.Tensor, x: torch.Tensor, q: QuantizedWeight) -> None:
    """got is the float64 product of the weight with x rounded to 8 bits per group, up to float32
    sums and (bf16 results) the output's rounding; and within that rounding's bound of x @ W.T."""
    weight, rounded = reference_weight(q), rounded_to_8_bits(x, q.group_size)
    want = rounded @ weight.T
    bound = 1e-5 * (rounded.abs() @ weight.abs().T)
    if got.dtype == torch.bfloat16:
        bound += want.abs() * 2**-8
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"worst excess {(error - bound).max().item():.3g}"
    exact = x.double() @ weight.T
    rounding = (x.double() - rounded).abs() @ weight.abs().T  # |sum w e| <= sum |w| |e|
    assert ((got.double() - exact).abs() <= rounding + bound).all()
    assert (got.double() - exact).abs().max() > 0


@needs_gemm_q8
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 16), (4, 128)])
def test_few_rows_in_8_bits_equal_those_rows_in_a_batch(bits, group):
    """One-part quant_gemv_q8 (decode rows, where batches take quant_gemm_q8) gives each row exactly
    what quant_gemm_q8 gives it among many: greedy text must not depend on how rows were batched."""
    q = random_weight(80, 256, bits, group, seed=bits + group, half=bits == 4)
    w = InterleavedWeight.from_rows(q)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(group)).bfloat16()
    batch = torch.ops.tokenmill.quant_gemm_q8(x, w.codes, w.scales, w.offsets, bits, group, 80)
    for start, count in ((0, 1), (1, 2), (5, 3), (9, 4), (17, 5), (30, 8)):
        few = torch.ops.tokenmill.quant_gemv_q8(x[start : start + count], w.codes, w.scales, w.offsets, bits, group,
                                                80, False)
        assert torch.equal(few, batch[start : start + count])


@needs_gemm_q8
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 32), (8, 16), (4, 128)])
@pytest.mark.parametrize("rows", [9, 13, 64])
def test_gemm_q8_with_silu_and_mul_equals_the_product_then_silu_and_mul(bits, group, rows):
    """A fused [gate; up] weight: silu(gate) * up computed in quant_gemm_q8's tiles is, bit for bit,
    the [M, 2I] product followed by silu_and_mul (both round gate and up to bf16 first)."""
    intermediate = 96  # 6 gate blocks, each with its up block 6 blocks on
    q = random_weight(2 * intermediate, 256, bits, group, seed=rows + bits, half=rows % 2 == 0)
    w = InterleavedWeight.from_rows(q)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(group)).bfloat16()
    args = (w.codes, w.scales, w.offsets, bits, group, 2 * intermediate)
    fused = torch.ops.tokenmill.quant_gemm_q8_silu_and_mul(x, *args)
    product = torch.ops.tokenmill.quant_gemm_q8(x, *args)
    assert fused.shape == (rows, intermediate) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, torch.ops.tokenmill.silu_and_mul(product))
    gate, up = product.float().chunk(2, dim=-1)
    torch.testing.assert_close(fused.float(), torch.nn.functional.silu(gate) * up, rtol=2**-7, atol=1e-6)
    odd = InterleavedWeight.from_rows(random_weight(48, 256, bits, group))  # 3 blocks: no pairs
    with pytest.raises(RuntimeError, match="multiple of 32 rows"):
        torch.ops.tokenmill.quant_gemm_q8_silu_and_mul(x, odd.codes, odd.scales, odd.offsets, bits, group, 48)


@needs_q8_kernel
@pytest.mark.skipif(not gemm_backends(), reason="quant_gemm needs AVX-512 BF16")
def test_which_kernel_many_bf16_rows_take(monkeypatch):
    """Past 8 rows an interleaved bf16 layer multiplies with quant_gemm where it is available (with
    quant_gemm_q8 where that is and the layer rounds its rows to 8 bits, quant_gemm or not), else
    with its weight dequantized for the call (or a packed copy, where it was given one)."""
    q = random_weight(64, 576, 4, 32)
    layer = QuantizedLinear(InterleavedWeight.from_rows(q))
    x = torch.randn(40, 576).bfloat16()
    calls = []
    real = quantized._gemm_matmul
    monkeypatch.setattr(quantized, "_gemm_matmul", lambda *args: calls.append(len(args[0])) or real(*args))
    monkeypatch.setattr(quantized, "_gemm_kernel_available", lambda: True)
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: False)
    assert torch.equal(layer(x), gemm(x, q, 0)) and calls == [40]
    layer(x[:8])  # the VNNI kernel's rows
    layer(x.float())  # not bf16
    assert calls == [40]
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: True)  # CPUs without AMX
    assert torch.equal(layer(x), gemm(x, q, 0)) and calls == [40, 40]  # the layer keeps 16 bits
    layer.activation_bits = 8
    w = layer.qweight
    assert torch.equal(layer(x), torch.ops.tokenmill.quant_gemm_q8(x, w.codes, w.scales, w.offsets, 4, 32, 64))
    assert calls == [40, 40, 40]
    monkeypatch.setattr(quantized, "_gemm_kernel_available", lambda: False)  # CPUs without AVX-512 BF16
    layer(x)
    assert calls == [40, 40, 40, 40]
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: False)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, q.dequantize(torch.bfloat16)), rtol=0,
                               atol=1e-2)
    assert calls == [40, 40, 40, 40]


@needs_q8_kernel
@pytest.mark.parametrize("bits,group,half", [(4, 32, True), (8, 32, True), (4, 64, False), (8, 128, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_interleaved_rows_equal_the_row_layouts_bit_for_bit(bits, group, half, dtype, monkeypatch):
    """quant_rows_q8 (embedding lookups of an interleaved table) gives the row layout's kernel
    dequantization exactly, rows of the padded last block and repeats included; the torch path it
    replaces agrees within one rounding."""
    q = random_weight(37, 2 * group, bits, group, seed=bits + group, half=half)  # 37 rows: 3 blocks, the last padded
    w = InterleavedWeight.from_rows(q)
    ids = torch.tensor([0, 36, 15, 16, 5, 36, 33])
    got = w.dequantize_rows(ids, dtype)
    assert got.dtype == dtype and got.shape == (7, 2 * group)
    assert torch.equal(got, q.rows(ids).dequantize(dtype))
    torch.testing.assert_close(got.double(), reference_weight(q)[ids].to(dtype).double(), rtol=0,
                               atol=float(reference_weight(q).abs().max()) * (2e-2 if dtype != torch.float32 else 1e-6))
    monkeypatch.setattr(quantized, "_q8_kernel_available", lambda: False)
    torch.testing.assert_close(w.dequantize_rows(ids, dtype), got, rtol=1e-2 if dtype != torch.float32 else 1e-6,
                               atol=1e-6)
    with pytest.raises(RuntimeError, match="not a row"):
        torch.ops.tokenmill.quant_rows_q8(w.codes, w.scales, w.offsets, bits, group, 37, torch.tensor([37]), dtype)


def test_interleaving_a_model_keeps_a_tied_table_shared():
    q = random_weight(40, 64, 8, 32)
    model = torch.nn.ModuleDict({"embed": QuantizedEmbedding(q, torch.float32), "head": QuantizedLinear(q),
                                 "other": QuantizedLinear(random_weight(8, 64, 4, 32))})
    ids = torch.tensor([0, 39, 7])
    before = model["embed"](ids)
    assert interleave_weights(model) == 2
    assert isinstance(model["head"].qweight, InterleavedWeight) and model["head"].qweight is model["embed"].qweight
    torch.testing.assert_close(model["embed"](ids), before, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 4, 8, 9, 17, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_matmul_any_row_count(rows, bits, monkeypatch):
    q = random_weight(40, 192, bits, 32, seed=rows)
    x = torch.randn(rows, 192)
    want = x.double() @ reference_weight(q).T
    exact = quantized_matmul(x, q, activation_bits=None)  # (the default may round x: quant_gemv_i8 on AVX2)
    torch.testing.assert_close(exact.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    monkeypatch.setattr(quantized, "_kernel_available", lambda: False)  # the fallback every device has
    monkeypatch.setattr(quantized, "_gemm_i8_kernel_available", lambda: False)
    torch.testing.assert_close(quantized_matmul(x, q).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_kernel_refuses_mismatched_shapes():
    if not quant_gemv_available():
        pytest.skip("no kernel")
    q = random_weight(8, 64, 4, 32)
    with pytest.raises(RuntimeError, match="codes do not match K"):
        torch.ops.tokenmill.quant_gemv(torch.randn(1, 128), q.codes, q.scales, q.offsets, 4, 32)


@pytest.mark.parametrize("bits", [4, 8])
def test_round_to_nearest_error_is_half_a_step(bits):
    w = torch.randn(64, 256) * 0.05
    q = quantize_rtn(w, bits)
    assert q.scales.dtype == torch.float16  # chosen so that float16 holds them
    step = q.scales.float().repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert q.nbytes < w.numel() * (1.2 if bits == 8 else 0.7)


def test_concat_widens_without_changing_values():
    parts = [random_weight(16, 256, 4, 32, 1), random_weight(8, 256, 8, 16, 2), random_weight(8, 256, 8, 32, 3)]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group_size) == (8, 16)
    torch.testing.assert_close(fused.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)
    same = concat_rows(parts[:1] * 2)
    assert (same.bits, same.group_size) == (4, 32)


def test_rows_and_columns_cut_on_groups():
    q = random_weight(12, 256, 4, 32)
    full = q.dequantize()
    torch.testing.assert_close(q.rows(slice(4, 8)).dequantize(), full[4:8], rtol=0, atol=0)
    torch.testing.assert_close(q.columns(64, 192).dequantize(), full[:, 64:192], rtol=0, atol=0)
    with pytest.raises(ValueError, match="groups"):
        q.columns(16, 128)


def test_linear_adds_its_bias():
    q = random_weight(10, 64, 8, 32)
    bias = torch.randn(10)
    x = torch.randn(2, 64)
    layer = QuantizedLinear(q, bias)
    torch.testing.assert_close(layer(x), quantized_matmul(x, q) + bias, rtol=0, atol=0)
    layer.activation_bits = None  # float32 activations: the dequantized weight's product
    torch.testing.assert_close(layer(x), x @ q.dequantize().T + bias, rtol=1e-5, atol=1e-5)


def _gguf_blocks(type_name: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, T[type_name])
    block, size = gguf.constants.GGML_QUANT_SIZES[T[type_name]]  # K-quants: random blocks with sane scales
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if type_name == "Q6_K":
        raw[..., -2:] = scale
    else:
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    return raw.reshape(shape[0], -1)


# 544 columns: a last chunk of 32 (an odd number of 32-blocks); K-quants come in 256-column super-blocks
@pytest.mark.parametrize(("type_name", "cols"), [(t, c) for t in QUANTIZED_TYPES for c in (512, 544)
                                                 if c % 256 == 0 or not t.endswith("_K")])
def test_repacked_gguf_types_equal_the_gguf_packages_dequantization(type_name, cols):
    import gguf

    shape = (24, cols)
    data = _gguf_blocks(type_name, shape)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]).reshape(shape)
    q = repack(data, type_name, shape)
    assert q.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
    torch.testing.assert_close(q.dequantize(), torch.from_numpy(want.astype(np.float32)), rtol=1e-6, atol=1e-7)
    x = torch.randn(2, shape[1])
    reference = x @ torch.from_numpy(want.astype(np.float32)).T
    torch.testing.assert_close(quantized_matmul(x, q, activation_bits=None), reference, rtol=1e-4, atol=1e-4)
    # by default x may be rounded to ~16 bits per group (quant_gemv_i8 on AVX2; its error grows with the codes,
    # which it takes 128 off for 8-bit ones: Q5_K's, all small, come out ~1.5e-4 of the largest output)
    torch.testing.assert_close(quantized_matmul(x, q), reference, rtol=0, atol=1e-3 * reference.abs().max().item())


def _greedy(loaded, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    from test_models import _our_logits

    ids, logits = list(prompt), []
    for _ in range(steps):
        last = _our_logits(loaded, [ids])[0][-1]
        logits.append(last)
        ids.append(int(last.argmax()))
    return ids[len(prompt):], logits


def test_tiny_gguf_keeps_every_type_quantized_and_matches_its_dequantized_self(tmp_path):
    arch = "llama"  # its Q/K rows are permuted in the file: the repacked rows must be put back too
    from test_gguf import write_tiny_gguf

    from tokenmill.models.loader import load_model

    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch)
    cpu = torch.device("cpu")
    kept = load_model(str(path), torch.float32, cpu, tokenizer="none")
    plain = load_model(str(path), torch.float32, cpu, tokenizer="none", quantization="none")
    layer0, layer1 = kept.model.layers
    # layer 0 mixes float and quantized parts in its fused projections: those are dequantized
    assert type(layer0.self_attn.qkv_proj).__name__ != "QuantizedLinear"
    assert isinstance(layer0.mlp.down_proj, QuantizedLinear)  # Q8_0
    # layer 1: Q4_K / Q5_K / Q6_K everywhere, q/k/v fused into one widened layout
    assert isinstance(layer1.self_attn.qkv_proj, QuantizedLinear)
    assert (layer1.self_attn.qkv_proj.qweight.bits, layer1.self_attn.qkv_proj.qweight.group_size) == (8, 16)
    assert layer1.self_attn.o_proj.qweight.bits == 4
    assert isinstance(kept.model.lm_head, QuantizedLinear)  # tied to the Q8_0 embedding
    prompt = [5, 17, 123, 42, 7, 250, 3]
    tokens_kept, logits_kept = _greedy(kept, prompt, 12)
    tokens_plain, logits_plain = _greedy(plain, prompt, 12)
    assert tokens_kept == tokens_plain
    # float32 activations: float32 rounding; on AVX2 the decode rows are rounded to ~16 bits per group
    # (quant_gemv_i8's two 8-bit parts): ~1e-4 of the logits' size
    tolerance = 1e-3 if quant_gemv_i8_available() else 1e-4
    for a, b in zip(logits_kept, logits_plain):
        assert (a - b).abs().max().item() <= tolerance
    assert logits_plain[0].std() > 0.1


@pytest.mark.skipif(not quant_gemm_available(), reason="batches read the codes only where quant_gemm runs")
def test_bf16_gguf_batches_read_the_codes_and_match_the_packed_copy(tmp_path, monkeypatch):
    """bf16 on a CPU where quant_gemm runs: the quantized linears keep no bf16 copy, and prompts
    (past 8 rows: quant_gemm) give, within bf16 noise, the logits of the same model whose linears
    multiply batches with a oneDNN-packed copy, along the same tokens."""
    from test_gguf import write_tiny_gguf

    from tokenmill.models.loader import load_model

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama")
    cpu = torch.device("cpu")
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: False)  # bf16 products
    reading = load_model(str(path), torch.bfloat16, cpu, tokenizer="none")
    monkeypatch.setattr(quantized, "_gemm_kernel_available", lambda: False)
    packed = load_model(str(path), torch.bfloat16, cpu, tokenizer="none")
    layer = reading.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.batched is None
    assert packed.model.layers[1].mlp.down_proj.batched is not None
    prompt = [5, 17, 123, 42, 7, 250, 3, 99, 11, 64, 8, 200]
    monkeypatch.setattr(quantized, "_gemm_kernel_available", lambda: True)
    tokens, logits = _greedy(reading, prompt, 8)
    # the packed copy along the same tokens (a random tiny model in bf16 has near-ties, which either
    # path may break its own way): each token is its best or within the bound of it
    from test_models import _our_logits

    want_logits = list(_our_logits(packed, [prompt + tokens])[0][len(prompt) - 1 : -1])
    for token, a, b in zip(tokens, logits, want_logits):
        bound = 0.05 * b.abs().max().item()
        assert (a - b).abs().max().item() <= bound
        assert b[token].item() >= b.max().item() - bound
    assert not all(torch.equal(a, b) for a, b in zip(logits, want_logits))  # two different paths ran


@needs_gemm_q8
def test_bf16_gguf_rounds_few_rows_as_its_batches_do(tmp_path, monkeypatch):
    """Where batches take quant_gemm_q8 (VNNI, no AMX), the loader gives every quantized linear's
    few-row kernel the same 8-bit rounding, so a row's product does not depend on its batch; with
    the int8 batches off, few rows keep two 8-bit parts."""
    from test_gguf import write_tiny_gguf

    from tokenmill.models.loader import load_model

    path = tmp_path / "tiny-llama.gguf"
    write_tiny_gguf(path, "llama")
    cpu = torch.device("cpu")
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: True)
    eight = load_model(str(path), torch.bfloat16, cpu, tokenizer="none")
    layers = [m for m in eight.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) >= 5 and all(m.activation_bits == 8 for m in layers)
    for layer in layers:
        x = torch.randn(20, layer.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
        assert torch.equal(layer(x[3:6]), layer(x)[3:6])
    monkeypatch.setattr(quantized, "_gemm_q8_kernel_available", lambda: False)
    sixteen = load_model(str(path), torch.bfloat16, cpu, tokenizer="none")
    assert all(m.activation_bits == 16 for m in sixteen.model.modules() if isinstance(m, QuantizedLinear))


@pytest.mark.parametrize("bits", [8, 4])
def test_hf_model_quantized_at_load(tiny_llama_dir, tokenizer, bits):
    """An HF model quantized at load computes what the float model computes with the rounded weights."""
    from test_models import PROMPTS, _our_logits

    from tokenmill.models.loader import load_model

    cpu = torch.device("cpu")
    plain = load_model(str(tiny_llama_dir), torch.float32, cpu)
    quant = load_model(str(tiny_llama_dir), torch.float32, cpu, quantization=f"int{bits}")
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    before = _our_logits(plain, ids)
    for ours, theirs in zip(quant.model.layers, plain.model.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layer = ours.get_submodule(name)
            assert isinstance(layer, QuantizedLinear) and layer.qweight.bits == bits
            theirs.get_submodule(name).weight.data.copy_(layer.qweight.dequantize())
    rounded = _our_logits(plain, ids)
    for q, r, b in zip(_our_logits(quant, ids), rounded, before):
        assert (q - r).abs().max().item() <= 1e-4
        assert (r - b).abs().max().item() > 1e-3  # the rounding did change the weights


def test_unknown_quantization_is_a_load_error(tiny_llama_dir):
    from tokenmill.errors import ModelLoadError
    from tokenmill.models.loader import load_model

    with pytest.raises(ModelLoadError, match="quantization must be one of"):
        load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu"), quantization="int3")


@pytest.mark.parametrize("num_rows,cols", [(1, 32), (19, 96), (45, 128), (33, 160), (16, 576)])
def test_4_bit_groups_of_32_interleave_without_unpacking_as_unpacked_they_would(num_rows, cols):
    """from_rows moves 4-bit codes in groups of 32 straight from the packed bytes (64-column chunks,
    a last chunk of 32 columns included): the same layout as from the unpacked codes."""
    q = random_weight(num_rows, cols, 4, 32, seed=cols)
    pad, shape = -num_rows % 16, (-(-num_rows // 16), cols // 32, -1)
    moved, unpacked = quantized._moved_quads(q, pad).reshape(shape), quantized._unpacked_quads(q, pad).reshape(shape)
    assert torch.equal(moved, unpacked)
    assert torch.equal(InterleavedWeight.from_rows(q).codes, moved)
