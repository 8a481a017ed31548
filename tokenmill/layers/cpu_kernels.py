"""Our C++ CPU kernels (csrc/), built on first use with the machine's compiler.

One extension holds them all: paged decode attention (paged_decode.cpp), quantized-weight
matrix-vector products with float32 activations (quant_gemv.cpp) and, on CPUs with AVX-512
VNNI, with 8-bit ones (quant_gemv_q8.cpp), the same weights against many bf16 rows on AMX or
AVX-512 BF16 (quant_gemm.cpp) or, without AMX, with the rows rounded to 8 bits on VNNI
(quant_gemm_q8.cpp), causal attention of bf16 prompt chunks (prefill_attention.cpp),
and the small fused steps of every layer
(fused_ops.cpp: RMSNorm with the residual add, rotary, SiLU-and-multiply, the KV-cache write).
The build takes ~15 s once and is cached by torch.utils.cpp_extension under
~/.cache/torch_extensions, keyed by this CPU's feature flags and the sources
(builds use -march=native). All of that needs AVX-512. CPUs with AVX2 and FMA but no AVX-512 get
a smaller extension instead: quant_gemv_avx2.cpp (the same quant_gemv and quant_dequantize ops, so
that their decode steps read the quantized weights as they are, and quant_gemv_i8, which batches
of up to 64 rows use too) and fused_ops.cpp built for AVX2
(all of its ops but argmax_rows and apply_token_bitmask_), and decode_attention_rows.cpp, the
PyTorch attention backend's decode steps and KV writes, one op each, and decode_step_avx2.cpp, a
few-row decode step through every layer in one call (models/decode_plan.py); the rest takes the
PyTorch path there. Where no build is available, or with TOKENMILL_CPU_KERNELS=0, callers use their
PyTorch paths.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from tokenmill.platform import cpu_flags

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in (
    "paged_decode.cpp", "quant_gemv.cpp", "quant_gemv_q8.cpp", "quant_gemm.cpp", "quant_gemm_q8.cpp", "fused_ops.cpp",
    "decode_step.cpp", "prefill_attention.cpp")]
AVX2_SOURCES = [CSRC / name for name in (
    "quant_gemv_avx2.cpp", "fused_ops.cpp", "decode_attention_rows.cpp", "decode_step_avx2.cpp")]
HEADERS = [CSRC / name for name in (
    "vec_math.h", "quant_layout.h", "quant_gemv_q8.h", "quant_gemv_i8.h", "paged_decode.h", "fused_rows.h", "decode_rows.h",
    "decode_layers.h")]  # in the build fingerprint too
AVX2_FLAGS = {"avx2", "fma", "f16c"}


def kernels_enabled() -> bool:
    return os.environ.get("TOKENMILL_CPU_KERNELS", "1") != "0"


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (or load the cached build of) the AVX-512 kernels; False where they are unavailable."""
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    return _build("tokenmill_cpu_kernels", SOURCES)


@functools.cache
def load_avx2_kernels() -> bool:
    """Build (or load) quant_gemv_avx2.cpp on a CPU with AVX2 and FMA but without AVX-512."""
    if "AVX512" in torch.backends.cpu.get_cpu_capability() or not AVX2_FLAGS <= cpu_flags():
        return False
    return _build("tokenmill_avx2_kernels", AVX2_SOURCES)


def _build(name: str, sources: list[Path]) -> bool:
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            name=f"{name}_{_build_fingerprint(sources)}",
            sources=[str(source) for source in sources],
            # -fopenmp: at::parallel_for is inline OpenMP; it resolves to the libgomp torch loaded
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, an unexpected toolchain: run without it
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        logger.warning("CPU kernels unavailable, using the PyTorch path: %s", first_line)
        return False
    return True


@functools.cache
def kernels_available() -> bool:
    """Enabled and built: the ops are registered under torch.ops.tokenmill."""
    return kernels_enabled() and load_cpu_kernels()


@functools.cache
def quant_gemv_available() -> bool:
    """Whether quant_gemv and quant_dequantize are registered: with the AVX-512 kernels, or on
    an AVX2 CPU by their own build."""
    return kernels_enabled() and (load_cpu_kernels() or load_avx2_kernels())


@functools.cache
def fused_ops_available() -> bool:
    """Whether fused_ops.cpp's RMSNorm, rotary, SiLU-and-multiply and KV write are registered."""
    return quant_gemv_available()


@functools.cache
def quant_gemv_i8_available() -> bool:
    """quant_gemv_i8 (8- or 16-bit activations over the row layout) is the AVX2 build's."""
    return kernels_enabled() and load_avx2_kernels()


@functools.cache
def quant_gemm_i8_available() -> bool:
    """Whether batches of rows on an AVX2 CPU multiply the row layout's codes with quant_gemv_i8's
    batched loop too (up to quantized.I8_BATCH_MAX_ROWS rows, rounded as few rows are), rather
    than a float32 copy of the weight dequantized per call for oneDNN: 1.5-3x faster at 16 rows,
    ~2x for the 49k-row head at 64. TOKENMILL_INT8_GEMM=0 keeps the float32 copies."""
    return os.environ.get("TOKENMILL_INT8_GEMM", "auto") != "0" and quant_gemv_i8_available()


@functools.cache
def decode_attention_rows_available() -> bool:
    """decode_attention_rows (over TorchPagedAttention's cache layout) is the AVX2 build's."""
    return kernels_enabled() and load_avx2_kernels()


@functools.cache
def prefill_attention_available() -> bool:
    """prefill_attention_ and paged_prefill_attention_ (bf16 prompt chunks): the AVX-512 build's
    (vdpbf16ps with AVX-512 BF16, two FMAs a pair without)."""
    return kernels_available()


@functools.cache
def quant_gemv_q8_available() -> bool:
    """The 8-bit-activation kernel is built only where the compiler targets AVX-512 VNNI."""
    return kernels_available() and "avx512_vnni" in cpu_flags()


@functools.cache
def quant_gemm_available() -> bool:
    """Whether batches of bf16 rows multiply quantized weights with quant_gemm.cpp instead of a
    packed bf16 copy: wherever it has a backend (AMX tiles, else AVX-512 BF16; on both it measured
    as fast as oneDNN on the copy or faster, in ~300 MB less). TOKENMILL_QUANT_GEMM=0: the copy."""
    if os.environ.get("TOKENMILL_QUANT_GEMM", "auto") == "0" or not kernels_available():
        return False
    return torch.ops.tokenmill.quant_gemm_backends() > 0


@functools.cache
def quant_gemm_q8_available() -> bool:
    """Whether batches of bf16 rows multiply quantized weights with quant_gemm_q8.cpp (activations
    rounded to 8 bits per group, vpdpbusd) rather than quant_gemm.cpp's bf16 products: on CPUs
    with AVX-512 VNNI but no AMX (AMX tiles multiply bf16 faster than VNNI does 8 bits), where it
    measured faster (1.1-1.3x on the linears; 1.33x at 2,048 rows on Zen 5 since 2026-12-06), and
    on those without AVX-512 BF16 (Ice Lake, Cascade Lake), where quant_gemm has no backend at all;
    TOKENMILL_INT8_GEMM=0 keeps the bf16 products (or, without them, a bf16 copy of the weights).
    The loader then rounds few-row products to the same 8 bits (quantized.round_rows_like_batches),
    so caching and batching do not change greedy text. The cost: the default model's logits sit about twice as far from
    float32's as with bf16 products (its Q4_1 perplexity +0.54% over bf16's, against +0.19% with
    bf16 products; tests/test_default_model.py states the bounds)."""
    if (os.environ.get("TOKENMILL_INT8_GEMM", "auto") == "0" or os.environ.get("TOKENMILL_QUANT_GEMM", "auto") == "0"
            or not kernels_available()):
        return False
    return "avx512_vnni" in cpu_flags() and torch.ops.tokenmill.quant_gemm_backends() < 2


def _build_fingerprint(sources: list[Path], headers: list[Path] = HEADERS) -> str:
    """A short hash of this CPU's feature flags, the sources, and where they and torch's headers
    are: a cache shared by machines (an NFS home) must not hand one CPU's build to another, and two
    checkouts with their venvs must not rebuild over each other (the build files name both paths)."""
    flags = " ".join(sorted(cpu_flags())) or platform.processor() or platform.machine()
    digest = hashlib.sha1(flags.encode())
    digest.update(f"{sources[0].resolve().parent}|{Path(torch.__file__).resolve().parent}".encode())
    for source in sources + headers:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]
