"""Linear and embedding layers whose weights stay group-quantized in memory (4 or 8 bits).

One layout covers every GGUF type we read and our own round-to-nearest quantization: unsigned
codes u, and per group of G consecutive input columns of an output row a scale s and an offset o:

    w[n, k] = s[n, k // G] * u[n, k] + o[n, k // G]

Q4_0 is 4-bit with o = -8 s, Q4_1 and Q4_K 4-bit with o = their min, Q8_0 8-bit with u = q + 128
and o = -128 s, Q5_K 8-bit, Q6_K 8-bit with G = 16 (see models/gguf_quants.py).

A few rows (decode) go through our CPU kernels, which read the codes from memory as they are.
float32 activations stay float32 (csrc/quant_gemv.cpp, over this row layout: the dequantized
weight's product up to float32 rounding). For bfloat16/float16 models on CPUs with AVX-512 VNNI,
the loader re-lays each linear's weight out once as an InterleavedWeight (16 output rows side by
side per group, the operand layout of vpdpbusd) for csrc/quant_gemv_q8.cpp, which rounds the
activations per group of the weight's to a layer's `activation_bits`: 16 by default (two 8-bit
parts, ~exact: the default model's perplexity on the decode path is bf16's to 0.01%) or 8 (as
llama.cpp does; the offsets then take the rounded rows' sums: int8 weights +0.44% perplexity on
the decode path; benchmarks/perplexity.py). That kernel's integer sums stay in
one lane per output row, so it needs no horizontal sums and reads the weights at memory speed.
More rows (prefill, large decode batches) of a bf16 model go, on CPUs with AMX or AVX-512 BF16,
through csrc/quant_gemm.cpp, which dequantizes the interleaved weight into cache-sized bf16
panels as it multiplies (on AMX tiles, else vdpbf16ps), so no bf16 copy of the weights is kept
(cpu_kernels.quant_gemm_available says where); on CPUs with VNNI but no AMX (unless
TOKENMILL_INT8_GEMM=0), through csrc/quant_gemm_q8.cpp instead, which rounds the rows to 8 bits per group and
multiplies the codes with vpdpbusd (~1.1-1.35x; +0.3-0.4% perplexity over the bf16 products), AVX-512 BF16
or not (Ice Lake and Cascade Lake have VNNI without it: dtype "auto" gives quantized models bf16 there,
platform.resolve_dtype); the
loader then sets every layer's activation_bits to 8 (round_rows_like_batches), which is what
sends its batches there, and its few rows get the same rounding, bit for bit. Elsewhere they use `batched`, a dense module over the dequantized weight that
layers/linear.py packs for oneDNN once at load on bf16 CPUs; where there is none, a call
dequantizes the weight for itself. CPUs with AVX2 but no AVX-512 have quant_gemv, quant_gemv_i8
and the dequantizer (csrc/quant_gemv_avx2.cpp): few rows and batches read the codes there too
(uses_batched_i8), each row rounded and summed as it would be alone; to 8 bits per group where
dtype "auto" chose float32 (round_rows_like_batches; llama.cpp rounds its activations so too).
Without any kernel (other CPUs) few rows go the dequantizing way: correct, not fast. On CUDA the
loader gives 4-bit linears torch's int4 matmul as their `batched` module and swaps the others for
dense copies (layers/gpu_quantized.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.cpu_kernels import (
    quant_gemm_available, quant_gemm_i8_available, quant_gemm_q8_available, quant_gemv_available,
    quant_gemv_i8_available, quant_gemv_q8_available,
)
from tokenmill.platform import release_free_memory

CHUNK = 64  # columns per packed 4-bit chunk (the kernel's vector width in bytes)
GEMV_MAX_ROWS = 8  # at most this many rows go through the matrix-vector kernel
# on AVX2 CPUs, a layer with 16-bit activations (two 8-bit parts) sends batches of up to this many
# rows through quant_gemv_i8's batched loop and more through oneDNN on a float32 copy dequantized
# per call, faster there than two parts; with 8-bit ones (dtype "auto" there) every batch goes
# through the batched loop
I8_BATCH_MAX_ROWS = 64


@dataclass
class QuantizedWeight:
    """A [N, K] weight as codes + per-group scales and offsets. 4-bit codes are packed two to a
    byte per 64-column chunk: byte j holds column j (low nibble) and j + 32 (high); a last chunk
    of 32 columns holds j and j + 16."""

    codes: torch.Tensor  # uint8 [N, K] (8-bit) or [N, K / 2] (4-bit)
    scales: torch.Tensor  # [N, K / G], float16 where that holds them exactly (Q4_0, Q4_1, Q8_0, ours), else float32
    offsets: torch.Tensor  # [N, K / G], the same dtype
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    @classmethod
    def from_codes(cls, u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
                   group_size: int) -> QuantizedWeight:
        """From unpacked codes u (uint8 [N, K]); checks the layout."""
        rows, cols = u.shape
        if group_size % 16 or cols % 32 or cols % group_size:
            raise ValueError(f"cannot hold a [{rows}, {cols}] weight in groups of {group_size}")
        if scales.shape != (rows, cols // group_size) or offsets.shape != scales.shape:
            raise ValueError("scales and offsets must be [N, K / group_size]")
        if bits == 4 and u.numel() and int(u.max()) > 15:
            raise ValueError("4-bit codes must be below 16")
        codes = pack_nibbles(u) if bits == 4 else u.to(torch.uint8).contiguous()
        scales, offsets = compact_scales(scales.float(), offsets.float())
        return cls(codes, scales, offsets, bits, group_size)

    def to(self, device: torch.device) -> QuantizedWeight:
        return replace(self, codes=self.codes.to(device), scales=self.scales.to(device), offsets=self.offsets.to(device))

    def unpacked_codes(self) -> torch.Tensor:
        return unpack_nibbles(self.codes, self.shape[1]) if self.bits == 4 else self.codes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.codes.device.type == "cpu" and _kernel_available():  # ~10x faster: most of packing at load
            return torch.ops.tokenmill.quant_dequantize.default(self.codes, self.scales, self.offsets, self.bits,
                                                                self.group_size, dtype)
        return _dequantize(self.unpacked_codes(), self.scales, self.offsets, self.group_size, dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.rows(ids).dequantize(dtype)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the selected output rows (llama.cpp's Q/K permutation, tensor-parallel shards)."""
        return replace(self, codes=self.codes[index].contiguous(), scales=self.scales[index].contiguous(),
                       offsets=self.offsets[index].contiguous())

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """Input columns [start, end), cut on group boundaries (row-parallel shards)."""
        if start % self.group_size or end % self.group_size or (end - start) % 32:
            raise ValueError(f"columns {start}:{end} do not fall on the weight's {self.group_size}-column groups")
        g0, g1 = start // self.group_size, end // self.group_size
        return QuantizedWeight.from_codes(self.unpacked_codes()[:, start:end], self.scales[:, g0:g1],
                                          self.offsets[:, g0:g1], self.bits, self.group_size)

    def widened(self, bits: int, group_size: int) -> QuantizedWeight:
        """The same values with at least as many bits and groups no larger (lossless)."""
        if (bits, group_size) == (self.bits, self.group_size):
            return self
        if bits < self.bits or self.group_size % group_size:
            raise ValueError("can only widen a quantized layout")
        repeat = self.group_size // group_size
        return QuantizedWeight.from_codes(self.unpacked_codes(), self.scales.repeat_interleave(repeat, dim=1),
                                          self.offsets.repeat_interleave(repeat, dim=1), bits, group_size)


LANES = 16  # output rows side by side in the interleaved layout (one vpdpbusd's int32 lanes)


@dataclass
class InterleavedWeight:
    """A QuantizedWeight laid out for the VNNI kernel (see csrc/quant_gemv_q8.cpp): output rows in
    blocks of 16 (the last padded with zeros); per block and group, the 16 rows' codes four columns
    at a time side by side ("quads"), 4-bit quads j and j + G / 8 sharing bytes (low, high nibble)."""

    codes: torch.Tensor  # uint8 [B, K / G, 16 G bits / 8], B = ceil(N / 16)
    scales: torch.Tensor  # [B, K / G, 16]
    offsets: torch.Tensor  # [B, K / G, 16]
    bits: int
    group_size: int
    num_rows: int  # N

    @classmethod
    def from_rows(cls, q: QuantizedWeight) -> InterleavedWeight:
        rows, cols = q.shape
        group, blocks = q.group_size, -(-rows // LANES)
        pad = blocks * LANES - rows
        quads = _moved_quads(q, pad) if q.bits == 4 and group == 32 else _unpacked_quads(q, pad)
        codes = quads.reshape(blocks, cols // group, -1).contiguous()

        def lanes(values: torch.Tensor) -> torch.Tensor:
            values = torch.cat([values, values.new_zeros(pad, values.shape[1])]) if pad else values
            return values.view(blocks, LANES, -1).transpose(1, 2).contiguous()

        return cls(codes, lanes(q.scales), lanes(q.offsets), q.bits, q.group_size, rows)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The selected output rows, in the row layout."""
        return QuantizedWeight.from_codes(*self._row_parts(index), self.bits, self.group_size)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The selected rows' weights [len(ids), K] (embedding lookups of a tied head): by
        quant_rows_q8 on the CPU (~10 us a token, the torch ops below ~120 us), which rounds as
        QuantizedWeight.dequantize's kernel does (one fused multiply-add)."""
        if self.codes.device.type == "cpu" and _q8_kernel_available():
            return torch.ops.tokenmill.quant_rows_q8.default(self.codes, self.scales, self.offsets, self.bits,
                                                             self.group_size, self.num_rows, ids, dtype)
        u, scales, offsets = self._row_parts(ids)
        return _dequantize(u, scales, offsets, self.group_size, dtype)

    def _row_parts(self, index: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unpacked codes [T, K], scales and offsets [T, K / G] of the selected rows."""
        ids = torch.arange(self.num_rows)[index] if isinstance(index, slice) else index
        block, lane = ids // LANES, ids % LANES
        blocks, groups, _ = self.codes.shape
        quads = self.codes.view(blocks, groups, -1, LANES, 4).permute(0, 3, 1, 2, 4)[block, lane]  # [T, groups, q, 4]
        if self.bits == 4:
            quads = torch.cat([quads & 0xF, quads >> 4], dim=2)
        scales, offsets = (t.transpose(1, 2)[block, lane] for t in (self.scales, self.offsets))
        return quads.reshape(len(ids), -1), scales, offsets

    def to_rows(self) -> QuantizedWeight:
        return self.rows(slice(None))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.to_rows().dequantize(dtype)


def _dequantize(u: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Weights [N, K] from unpacked codes [N, K] and scales/offsets [N, K / group_size]."""
    grouped = u.float().view(u.shape[0], -1, group_size)
    return torch.addcmul(offsets.float()[..., None], grouped, scales.float()[..., None]).view(u.shape).to(dtype)


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    rows, cols = u.shape
    u = u.to(torch.uint8)
    full = cols - cols % CHUNK
    body = u[:, :full].reshape(rows, -1, 2, CHUNK // 2)
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(rows, -1)]
    if cols % CHUNK:
        tail = u[:, full:].reshape(rows, 2, 16)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    return torch.cat(parts, dim=1).contiguous()


def _unpacked_quads(q: QuantizedWeight, pad: int) -> torch.Tensor:
    """The interleaved codes [B, groups, G / 4 quads (4-bit: G / 8 bytes of two), 16 rows, 4], from
    the codes unpacked (pad zero rows added)."""
    cols, group = q.shape[1], q.group_size
    u = torch.cat([q.unpacked_codes(), q.codes.new_zeros(pad, cols)]) if pad else q.unpacked_codes()
    quads = u.view(-1, LANES, cols // group, group // 4, 4).permute(0, 2, 3, 1, 4)  # [B, groups, quads, 16, 4]
    if q.bits == 4:
        half = group // 8
        quads = quads[:, :, :half] | (quads[:, :, half:] << 4)
    return quads


def _moved_quads(q: QuantizedWeight, pad: int) -> torch.Tensor:
    """_unpacked_quads of 4-bit codes in groups of 32 (~2.5x faster, most of interleaving at load): a
    quad's 4 bytes of two nibbles are bytes 4 j .. 4 j + 3 of its group in GGUF block order, moved
    as one int32 word."""
    words = _group_words_of_32(q.codes, q.shape[1])
    words = torch.cat([words, words.new_zeros(pad, *words.shape[1:])]) if pad else words
    return words.view(-1, LANES, words.shape[1], 4).permute(0, 2, 3, 1).contiguous().view(torch.uint8)


def regroup_nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 32], two 16-byte halves, -> the same shape: the first half's low nibbles with the
    second's as their high ones, then both halves' high nibbles. That takes a 64-column chunk of the
    row layout (byte j: columns j and j + 32) to its two groups of 32 as a GGUF Q4 block holds them
    (byte i: columns i and i + 16), and two such blocks back to a chunk. Eight bytes a word, masked:
    no shift crosses a byte (~2x the speed of the same on bytes)."""
    low = 0x0F0F0F0F0F0F0F0F
    first, second = pairs.reshape(-1, 2, 16).view(torch.int64).transpose(0, 1).contiguous()
    regrouped = torch.stack([(first & low) | ((second & low) << 4), ((first >> 4) & low) | (second & ~low)], dim=1)
    return regrouped.view(torch.uint8).reshape(pairs.shape)


def _group_words_of_32(codes: torch.Tensor, cols: int) -> torch.Tensor:
    """4-bit codes [N, K / 2] in the row layout as int32 words [N, K / 32, 4], per group of 32
    columns: word j holding the group's bytes 4 j .. 4 j + 3 (GGUF Q4 block order)."""
    rows, full = codes.shape[0], cols - cols % CHUNK
    groups = regroup_nibbles(codes[:, : full // 2].reshape(rows, -1, 32)).view(torch.int32).reshape(rows, -1, 4)
    if cols % CHUNK:  # a last chunk of 32 columns holds them so already
        groups = torch.cat([groups, codes[:, full // 2 :].view(torch.int32).reshape(rows, 1, 4)], dim=1)
    return groups


def unpack_nibbles(codes: torch.Tensor, cols: int) -> torch.Tensor:
    rows = codes.shape[0]
    full = cols - cols % CHUNK
    body = codes[:, : full // 2].reshape(rows, -1, CHUNK // 2)
    parts = [torch.stack([body & 0xF, body >> 4], dim=2).reshape(rows, -1)]
    if cols % CHUNK:
        tail = codes[:, full // 2 :]
        parts.append(torch.cat([tail & 0xF, tail >> 4], dim=1))
    return torch.cat(parts, dim=1)


def _to_half(values: torch.Tensor) -> torch.Tensor:
    """Values rounded to float16 (kept as float32), clamped into its range."""
    return values.clamp(-65504, 65504).half().float()


def compact_scales(scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and offsets as float16 when that loses nothing (2 bytes per group instead of 4)."""
    half_s, half_o = scales.half(), offsets.half()
    if torch.equal(half_s.float(), scales) and torch.equal(half_o.float(), offsets):
        return half_s.contiguous(), half_o.contiguous()
    return scales.contiguous(), offsets.contiguous()


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int = 32) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization: int8 symmetric, int4 asymmetric (min and range)."""
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, -1, group_size)
    if bits == 8:
        scales = _to_half(w.abs().amax(dim=-1) / 127)
        q = torch.round(w / scales.clamp_min(1e-30)[..., None]).clamp(-127, 127)
        return QuantizedWeight.from_codes((q + 128).to(torch.uint8).view(rows, cols), scales, -128 * scales, 8,
                                          group_size)
    if bits == 4:
        low, high = _to_half(w.amin(dim=-1)), w.amax(dim=-1)
        scales = _to_half((high - low) / 15)
        q = torch.round((w - low[..., None]) / scales.clamp_min(1e-30)[..., None]).clamp(0, 15)
        return QuantizedWeight.from_codes(q.to(torch.uint8).view(rows, cols), scales, low, 4, group_size)
    raise ValueError(f"bits must be 4 or 8, not {bits}")


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights by output rows (fused q/k/v, gate/up), widened to one common layout."""
    bits, group = max(p.bits for p in parts), min(p.group_size for p in parts)
    parts = [p.widened(bits, group) for p in parts]
    scales, offsets = compact_scales(torch.cat([p.scales.float() for p in parts]), torch.cat([p.offsets.float() for p in parts]))
    return QuantizedWeight(torch.cat([p.codes for p in parts]).contiguous(), scales, offsets, bits, group)


AnyQuantizedWeight = QuantizedWeight | InterleavedWeight


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether x (its rows) goes through the quantized matrix-vector kernel."""
    return x.device.type == "cpu" and x.shape[0] <= GEMV_MAX_ROWS and _kernel_available()


def uses_gemm_kernel(x: torch.Tensor, qweight: AnyQuantizedWeight, activation_bits: int | None) -> bool:
    """Whether x (many bf16 rows) against this weight goes through csrc/quant_gemm.cpp, or
    quant_gemm_q8.cpp for a layer rounding its rows to 8 bits (_rounds_batch_to_8_bits)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and isinstance(qweight, InterleavedWeight)
            and (_rounds_batch_to_8_bits(activation_bits) or _gemm_kernel_available()))


def uses_batched_i8(x: torch.Tensor, qweight: AnyQuantizedWeight, activation_bits: int | None) -> bool:
    """Whether more than GEMV_MAX_ROWS rows go through quant_gemv_i8's batched loop (AVX2 CPUs),
    rounded as the layer's few rows are: up to I8_BATCH_MAX_ROWS rows (decode batches, short
    prompts, prefix-cache hits), where it beats dequantizing the weight for oneDNN, or every batch
    of a layer rounding to 8 bits."""
    return (activation_bits is not None and (activation_bits == 8 or x.shape[0] <= I8_BATCH_MAX_ROWS)
            and x.device.type == "cpu" and isinstance(qweight, QuantizedWeight) and qweight.group_size % 32 == 0
            and _gemm_i8_kernel_available())


def quantized_matmul(x: torch.Tensor, qweight: AnyQuantizedWeight, activation_bits: int | None = 16) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] in x's dtype. activation_bits: what a few-row kernel may round x to
    (8 or 16): the VNNI kernel for an InterleavedWeight, quant_gemv_i8 (AVX2 CPUs) for the row
    layout; None keeps it float32 (the row layout's float kernel). Batches: see uses_gemm_kernel
    and uses_batched_i8."""
    if uses_kernel(x):
        return _kernel_matmul(x, qweight, activation_bits)
    if uses_gemm_kernel(x, qweight, activation_bits):
        return _gemm_matmul(x, qweight, activation_bits)
    if uses_batched_i8(x, qweight, activation_bits):
        return _i8_matmul(x, qweight, activation_bits == 16)
    return F.linear(x, qweight.dequantize(x.dtype))


def _kernel_matmul(x: torch.Tensor, q: AnyQuantizedWeight, activation_bits: int | None) -> torch.Tensor:
    if isinstance(q, InterleavedWeight):
        if activation_bits is None or not _q8_kernel_available():
            q = q.to_rows()  # slow: a layer asked for float32 activations after load
        else:
            return _vnni_matmul(x, q, activation_bits == 16)
    elif activation_bits is not None and q.group_size % 32 == 0 and _i8_kernel_available():
        return _i8_matmul(x, q, activation_bits == 16)
    return torch.ops.tokenmill.quant_gemv.default(x, q.codes, q.scales, q.offsets, q.bits, q.group_size)


def _i8_matmul(x: torch.Tensor, q: QuantizedWeight, two_parts: bool) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemv_i8.default(x, q.codes, q.scales, q.offsets, q.bits, q.group_size, two_parts)


def _vnni_matmul(x: torch.Tensor, q: InterleavedWeight, two_parts: bool) -> torch.Tensor:
    return torch.ops.tokenmill.quant_gemv_q8.default(x, q.codes, q.scales, q.offsets, q.bits, q.group_size,
                                                     q.num_rows, two_parts)


def _rounds_batch_to_8_bits(activation_bits: int | None) -> bool:
    """Whether a batch that uses_gemm_kernel goes through quant_gemm_q8 (else quant_gemm)."""
    return activation_bits == 8 and _gemm_q8_kernel_available()


def _gemm_matmul(x: torch.Tensor, q: InterleavedWeight, activation_bits: int | None) -> torch.Tensor:
    if _rounds_batch_to_8_bits(activation_bits):
        return torch.ops.tokenmill.quant_gemm_q8.default(x, q.codes, q.scales, q.offsets, q.bits, q.group_size,
                                                         q.num_rows)
    return torch.ops.tokenmill.quant_gemm.default(x, q.codes, q.scales, q.offsets, q.bits, q.group_size, q.num_rows)


# names of this module's own, for tests to switch the kernels off
_kernel_available = quant_gemv_available
_q8_kernel_available = quant_gemv_q8_available
_i8_kernel_available = quant_gemv_i8_available
_gemm_kernel_available = quant_gemm_available
_gemm_q8_kernel_available = quant_gemm_q8_available
_gemm_i8_kernel_available = quant_gemm_i8_available


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W group-quantized."""

    def __init__(self, qweight: AnyQuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qweight = qweight
        self.bias = bias
        self.out_features, self.in_features = qweight.shape
        self.batched: nn.Module | None = None  # the dense module for many rows, where one was made
        # what a few-row kernel may round inputs to (None: float32); 8 also sends batches to
        # quant_gemm_q8 where that runs (round_rows_like_batches)
        self.activation_bits: int | None = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_kernel(x):
            out = _kernel_matmul(x, self.qweight, self.activation_bits)
        elif self.batched is not None:
            return self.batched(x)
        elif uses_gemm_kernel(x, self.qweight, self.activation_bits):
            out = _gemm_matmul(x, self.qweight, self.activation_bits)
        elif uses_batched_i8(x, self.qweight, self.activation_bits):
            out = _i8_matmul(x, self.qweight, self.activation_bits == 16)
        else:
            out = F.linear(x, self.qweight.dequantize(x.dtype))
        return out if self.bias is None else out + self.bias

    def few_row_kernel(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """self(x) for x of at most GEMV_MAX_ROWS rows as one bound kernel call (the decode plan's),
        where the layer runs the VNNI kernel or quant_gemv_i8; None where it runs neither."""
        w, bits, bias = self.qweight, self.activation_bits, self.bias
        if bits is None:
            return None
        if isinstance(w, InterleavedWeight) and _q8_kernel_available():
            call = _vnni_matmul
        elif isinstance(w, QuantizedWeight) and w.group_size % 32 == 0 and _i8_kernel_available():
            call = _i8_matmul
        else:
            return None
        two_parts = bits == 16
        if bias is None:
            return lambda x: call(x, w, two_parts)
        return lambda x: call(x, w, two_parts) + bias

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """As a fused [gate; up] projection: silu(gate) * up, inside the GEMMs when `batched` can, or
        in quant_gemm_q8's tiles (the same values bit for bit, without the [M, 2I] product)."""
        if self.batched is not None and not uses_kernel(x) and hasattr(self.batched, "silu_and_mul"):
            return self.batched.silu_and_mul(x)
        w = self.qweight
        if (self.batched is None and self.bias is None and not uses_kernel(x)
                and uses_gemm_kernel(x, w, self.activation_bits) and _rounds_batch_to_8_bits(self.activation_bits)
                and w.num_rows % 32 == 0):
            return torch.ops.tokenmill.quant_gemm_q8_silu_and_mul.default(x, w.codes, w.scales, w.offsets, w.bits,
                                                                          w.group_size, w.num_rows)
        return silu_and_mul(self(x))

    def extra_repr(self) -> str:
        q = self.qweight
        return (f"in={self.in_features}, out={self.out_features}, bits={q.bits}, group={q.group_size}, "
                f"activation_bits={self.activation_bits}")


def quantize_linear_layers(module: nn.Module, bits: int, group_size: int = 32) -> None:
    """Swap every nn.Linear inside `module` whose width divides into groups for a QuantizedLinear
    with its weight rounded to nearest (weight-only)."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % group_size == 0:
                bias = None if child.bias is None else child.bias.data
                setattr(parent, name, QuantizedLinear(quantize_rtn(child.weight.data, bits, group_size), bias))


class QuantizedEmbedding(nn.Module):
    """Token embeddings from a quantized table: only the looked-up rows are dequantized."""

    def __init__(self, qweight: AnyQuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = qweight
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = qweight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize_rows(ids, self.dtype)


def interleave_weights(model: nn.Module) -> int:
    """Re-lay every quantized weight of the model out for the VNNI kernel, in place of its row
    layout (a tied embedding and head keep sharing one table); returns how many were."""
    done: dict[int, InterleavedWeight] = {}
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and isinstance(module.qweight, QuantizedWeight):
            key = id(module.qweight)
            if key not in done:
                done[key] = InterleavedWeight.from_rows(module.qweight)
            module.qweight = done[key]
            # the row layout let go stays resident until trimmed: trimmed once at the end, the
            # default model's load peaked ~125 MB higher (a trim takes well under a millisecond)
            release_free_memory()
    return len(done)


def interleaving_pays(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode on this device and dtype runs the VNNI kernel (float32 keeps the exact one)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and _q8_kernel_available()


def batches_read_codes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether many rows multiply straight from the interleaved codes (csrc/quant_gemm.cpp, or
    quant_gemm_q8.cpp where the loader then rounds every layer's rows to 8 bits), so that quantized
    linears need no packed bf16 copy."""
    return (dtype == torch.bfloat16 and interleaving_pays(device, dtype)
            and (_gemm_kernel_available() or _gemm_q8_kernel_available()))


def rounds_rows_to_8_bits(device: torch.device, dtype: torch.dtype, dtype_was_auto: bool = False) -> bool:
    """Whether every quantized linear on this device and dtype rounds its activations to 8 bits per
    group, batches and few rows alike (round_rows_like_batches): where batches go through
    quant_gemm_q8 (VNNI without AMX); and on AVX2 CPUs for a float32 model whose dtype "auto" chose
    (their speed path, as llama.cpp's): quant_gemv_i8 then takes every batch in one 8-bit part,
    faster than two parts and than oneDNN on a dequantized float32 copy at every batch size
    measured (1-512 rows), and a prompt's rows are the same bits however it is cut. float32 asked
    for keeps two parts (~exact) and oneDNN for long batches."""
    if device.type != "cpu":
        return False
    if batches_read_codes(device, dtype) and _gemm_q8_kernel_available():
        return True
    return dtype_was_auto and dtype == torch.float32 and _gemm_i8_kernel_available()


def round_rows_like_batches(model: nn.Module) -> None:
    """Give every quantized linear's few-row kernel the 8-bit rounding that quant_gemm_q8 gives
    batches (one part, the same sums), and send its batches there: a row's product is then the
    same, bit for bit, whether it came alone (decode, a prefix-cache hit's last few tokens) or
    among many (a prompt), so greedy text does not depend on caching or batching."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear) and module.activation_bits is not None:
            module.activation_bits = 8


def describe_weight_formats(model: nn.Module, dtype: torch.dtype) -> str:
    """How the model's weights are held, e.g. "int4 g32 x 211, int8 g32 x 1; bfloat16 rest"."""
    counts: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and id(module.qweight) not in seen:
            seen.add(id(module.qweight))
            key = f"int{module.qweight.bits} g{module.qweight.group_size}"
            counts[key] = counts.get(key, 0) + 1
    rest = str(dtype).removeprefix("torch.")
    if not counts:
        return rest
    return ", ".join(f"{key} x {n}" for key, n in sorted(counts.items())) + f"; {rest} rest"
