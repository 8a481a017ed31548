"""Accelerators the planner knows, and "this CPU", measured once and cached.

Catalog figures are vendor datasheet values (dense bf16 tensor throughput, HBM/GDDR bandwidth)
and typical on-demand cloud prices per device-hour in late 2026; every one can be overridden.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tokenmill.errors import InvalidParameterError


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: float
    price_per_hour: float

    def with_overrides(self, **values) -> Accelerator:
        return replace(self, **{k: v for k, v in values.items() if v is not None})


CATALOG: dict[str, Accelerator] = {a.name.lower(): a for a in [
    Accelerator("L4", 24, 300, 121, 0.80),
    Accelerator("A10G", 24, 600, 70, 1.00),
    Accelerator("A100-40GB", 40, 1555, 312, 1.50),
    Accelerator("A100-80GB", 80, 2039, 312, 1.90),
    Accelerator("H100-SXM", 80, 3350, 989, 2.70),
    Accelerator("H200", 141, 4800, 989, 3.60),
    Accelerator("MI300X", 192, 5300, 1307, 2.60),
]}

CPU_PRICE_PER_HOUR = 0.10  # a small cloud VM; pass --cost-per-hour for yours
_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill" / "this_cpu.json"


def lookup(name: str) -> Accelerator:
    """A catalog entry by name (case-insensitive), or "cpu" for this machine's CPU."""
    key = name.lower()
    if key in ("cpu", "this-cpu", "this cpu"):
        return this_cpu()
    if key not in CATALOG:
        known = ", ".join(a.name for a in CATALOG.values())
        raise InvalidParameterError(f"unknown accelerator {name!r}; known: {known}, cpu", param="gpu")
    return CATALOG[key]


def match_cuda_device(device_name: str) -> Accelerator | None:
    """The catalog entry for a torch.cuda.get_device_name() string, if it is in the catalog."""
    name = device_name.upper()
    if "A100" in name:
        return CATALOG["a100-80gb" if "80GB" in name else "a100-40gb"]
    if "L40" in name:  # L40 / L40S are not the L4
        return None
    for key in ("h200", "h100-sxm", "mi300x", "a10g", "l4"):
        if key.split("-")[0].upper() in name:
            return CATALOG[key]
    return None


def this_cpu(refresh: bool = False) -> Accelerator:
    """This machine's CPU: matmul throughput and memory bandwidth measured (a few seconds), then cached."""
    import torch

    from tokenmill.platform import total_memory_bytes

    key = f"{platform.processor() or platform.machine()}|{_cpu_model()}|threads={torch.get_num_threads()}"
    if not refresh and _CACHE.is_file():
        try:
            cached = json.loads(_CACHE.read_text())
            if cached.get("key") == key:
                return Accelerator(**cached["accelerator"])
        except (OSError, ValueError, TypeError):
            pass
    accelerator = Accelerator(
        name="cpu", memory_gb=total_memory_bytes() / 1e9, bandwidth_gbs=measure_bandwidth_gbs(),
        bf16_tflops=measure_matmul_tflops(), price_per_hour=CPU_PRICE_PER_HOUR,
    )
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        _CACHE.write_text(json.dumps({"key": key, "accelerator": asdict(accelerator)}))
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
    return accelerator


def measure_matmul_tflops(size: int = 1024, seconds: float = 1.0) -> float:
    """Best sustained matmul TFLOP/s in the engine's CPU dtype (bf16 where native, else fp32)."""
    import torch

    from tokenmill.platform import resolve_dtype

    dtype = resolve_dtype("auto", torch.device("cpu"))
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.matmul(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best / 1e12


def measure_bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Memory bandwidth as a large copy sees it (bytes read + bytes written per second)."""
    import torch

    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = max(best, 2 * source.numel() * 4 / (time.perf_counter() - start))
    return best / 1e9


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
