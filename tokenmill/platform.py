"""Device and dtype choice: the one place that knows what hardware we run on.

torch is imported by the functions that need it, not by this module: a server whose engine runs
in another process reads the host's facts here and never loads torch (~220 MB resident).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.errors import InvalidParameterError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_device(device: str = "auto") -> torch.device:
    """"auto" picks CUDA when present, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise InvalidParameterError(f"unknown device {device!r}", param="device") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device 'cuda' asked for but CUDA is not available", param="device")
    return resolved


def nvidia_gpu_count() -> int:
    """NVIDIA GPUs the driver lists, read without initializing CUDA (a process that forks engine
    processes must not have): /proc/driver/nvidia/gpus, narrowed by CUDA_VISIBLE_DEVICES."""
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip() and not d.strip().startswith("-")]))
    return count


def cache_dir() -> Path:
    """Where tokenmill keeps what it computes once per machine: $TOKENMILL_CACHE_DIR, by default
    ~/.cache/tokenmill (under $XDG_CACHE_HOME where set)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill"
    return Path(os.environ.get("TOKENMILL_CACHE_DIR", default))


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 matmuls natively (AVX-512 BF16 or AMX) and torch runs its
    AVX-512 code there (not under ATEN_CPU_CAPABILITY=avx2, which also picks our AVX2 kernels)."""
    import torch

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags()) and "AVX512" in torch.backends.cpu.get_cpu_capability()


def cpu_multiplies_bf16_rows_in_int8() -> bool:
    """True when our quantized kernels multiply bf16 activations in 8-bit integers (AVX-512 VNNI:
    csrc/quant_gemv_q8.cpp, quant_gemm_q8.cpp), so that a model with quantized weights runs its
    matmuls at int8 speed in bf16 whether or not the CPU has bf16 arithmetic."""
    import torch

    return "avx512_vnni" in cpu_flags() and "AVX512" in torch.backends.cpu.get_cpu_capability()


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, quantized_weights: bool = False) -> torch.dtype:
    """"auto" is bfloat16 on CUDA and on CPUs with native bf16, float32 otherwise; except that
    quantized weights (a GGUF's own, or int8/int4 asked for) get bfloat16 on CPUs with AVX-512 VNNI
    but no bf16 arithmetic (Ice Lake, Cascade Lake): there the int8 kernels take bf16 rows, and
    float32 would send the weights through the float kernels (on an Ice Lake Xeon, the default
    model: ~3x slower decode, ~1.7x slower prefill). Dense weights keep float32 there: bf16
    matmuls without bf16 arithmetic were ~3.5x slower than float32 ones."""
    import torch

    dtypes = {name: getattr(torch, name) for name in DTYPE_NAMES}
    if isinstance(dtype, torch.dtype):
        if dtype not in dtypes.values():
            raise InvalidParameterError(f"unsupported dtype {dtype}", param="dtype")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        native = cpu_has_native_bf16() or (quantized_weights and cpu_multiplies_bf16_rows_in_int8())
        return torch.bfloat16 if native else torch.float32
    if dtype not in dtypes:
        raise InvalidParameterError(
            f"dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {dtype!r}", param="dtype"
        )
    return dtypes[dtype]


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, auto_float16: bool = False) -> torch.dtype:
    """The KV pool's dtype: "auto" is the model's, except that with auto_float16 a float32 model
    keeps float16, as llama.cpp does: half the memory, keys and values rounded once as they are
    written (the engine sets it where dtype "auto" chose float32 for a CPU without native bf16 and
    decode reads such a pool in one kernel). A float32 model may be given a 16-bit pool
    explicitly; a 16-bit model keeps its own dtype."""
    import torch

    if kv_cache_dtype == "auto":
        return torch.float16 if auto_float16 and dtype == torch.float32 else dtype
    if kv_cache_dtype not in DTYPE_NAMES:
        raise InvalidParameterError(
            f"kv_cache_dtype must be one of auto, {', '.join(DTYPE_NAMES)}; got {kv_cache_dtype!r}", param="kv_cache_dtype")
    chosen = getattr(torch, kv_cache_dtype)
    if chosen != dtype and dtype != torch.float32:
        raise InvalidParameterError(f"a {str(dtype).removeprefix('torch.')} model keeps its own KV cache dtype; "
                                    f"kv_cache_dtype {kv_cache_dtype} needs a float32 model", param="kv_cache_dtype")
    return chosen


def available_memory_bytes(device: torch.device) -> int:
    """Free memory on the device (CUDA) or available RAM (CPU)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo_bytes("MemAvailable") or int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def total_memory_bytes() -> int:
    """Installed RAM."""
    return _meminfo_bytes("MemTotal") or int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# oneDNN (and ideep, PyTorch's layer over it) keep a primitive per GEMM shape, and continuous
# batching makes many: one per batch size. ideep's default cache of 1024 grew a soak's RSS by
# hundreds of MB. 128 entries hold the shapes in use at any time (measured: no slower). Both are
# read once, when oneDNN first runs: set them before the model is loaded.
PRIMITIVE_CACHE_CAPACITY = "128"


def limit_onednn_primitive_cache() -> None:
    """Bound ideep's and oneDNN's primitive caches, unless the user set LRU_CACHE_CAPACITY /
    ONEDNN_PRIMITIVE_CACHE_CAPACITY."""
    os.environ.setdefault("LRU_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", PRIMITIVE_CACHE_CAPACITY)


def release_free_memory() -> None:
    """Hand memory that glibc keeps after frees back to the system (malloc_trim). Tensors of ever
    different sizes fragment the heap: a soak's RSS grew ~100 MB in minutes of mixed traffic that
    this recovers. Cheap (well under a millisecond); a no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def set_cpu_threads(num_ranks: int = 1) -> int:
    """Give each of num_ranks processes sharing this machine an equal share of its physical cores
    (hyper-threads slow GEMMs down) as torch intra-op threads, or of OMP_NUM_THREADS if the user
    pinned it. Idempotent: the same number whenever it is called. Returns it."""
    import torch

    threads = max(1, _cpu_budget() // num_ranks)
    torch.set_num_threads(threads)
    return threads


def _cpu_budget() -> int:
    pinned = os.environ.get("OMP_NUM_THREADS", "")
    if pinned.isdigit() and int(pinned) > 0:
        return int(pinned)
    return physical_cpu_cores()


def physical_cpu_cores() -> int:
    """Distinct (socket, core) pairs in /proc/cpuinfo; the logical CPU count where it cannot tell."""
    cores: set[tuple[str, str]] = set()
    physical_id = "0"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("physical id"):
                    physical_id = line.split(":", 1)[1].strip()
                elif line.startswith("core id"):
                    cores.add((physical_id, line.split(":", 1)[1].strip()))
    except OSError:
        pass
    return len(cores) or len(os.sched_getaffinity(0))
