"""Accelerators and their peaks: a catalog of GPUs, and this machine's CPU measured and cached.

Catalog figures are vendor datasheet values (dense bf16 tensor throughput, HBM/GDDR bandwidth)
and typical on-demand cloud prices per device-hour in late 2026; every one can be overridden.

CPU peaks are measured as the best of several short runs and cached per CPU model and thread
count. A measurement only ever raises the cached figures: one taken while the machine was busy
(lower) cannot replace a quiet one, and a later, better one replaces it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from tokenmill.errors import InvalidParameterError
from tokenmill.platform import release_free_memory


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
CPU_PEAKS_RUNS = 5  # short measurements per refresh; the best counts


@dataclass(frozen=True)
class CpuPeaks:
    """Measured peaks of this CPU at the engine's thread count."""

    bandwidth_gbs: float
    bf16_tflops: float
    measured_at: float = field(default=0.0, compare=False)  # time.time() of the last raise


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


def this_cpu() -> Accelerator:
    """This machine's CPU: cached peaks, or measured now (a few seconds) when there are none."""
    from tokenmill.platform import total_memory_bytes

    peaks = cached_cpu_peaks() or measure_cpu_peaks()
    return Accelerator(name="cpu", memory_gb=total_memory_bytes() / 1e9, bandwidth_gbs=peaks.bandwidth_gbs,
                       bf16_tflops=peaks.bf16_tflops, price_per_hour=CPU_PRICE_PER_HOUR)


def cache_path() -> Path:
    """cpu_peaks.json in tokenmill's cache directory (platform.cache_dir)."""
    from tokenmill.platform import cache_dir

    return cache_dir() / "cpu_peaks.json"


def machine_busy_fraction(seconds: float = 0.25) -> float:
    """Share of all CPUs' time spent busy over the next `seconds` (from /proc/stat); 0 where unknown.
    Another program's load would lower a measurement, so measurements wait for a quiet machine."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    first = sample()
    time.sleep(seconds)
    second = sample()
    if first is None or second is None or second[0] <= first[0]:
        return 0.0
    total, idle = second[0] - first[0], second[1] - first[1]
    return max(0.0, 1.0 - idle / total)


def cpu_key() -> str:
    """What the peaks depend on: the CPU model and the threads torch uses."""
    import torch

    return f"{_cpu_model()}|{platform.machine()}|threads={torch.get_num_threads()}"


def cached_cpu_peaks() -> CpuPeaks | None:
    """The best peaks measured so far for this CPU and thread count, if any."""
    entry = _read_cache().get(cpu_key())
    try:
        return None if entry is None else CpuPeaks(float(entry["bandwidth_gbs"]), float(entry["bf16_tflops"]),
                                                   float(entry.get("measured_at", 0.0)))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def measure_cpu_peaks(runs: int = CPU_PEAKS_RUNS, between_runs: Callable[[], bool] | None = None) -> CpuPeaks | None:
    """Measure `runs` times and keep the best, merged with the cache (each figure only ever rises);
    returns the merged peaks. between_runs(): asked before each run; False stops there (None if no
    run was made)."""
    best_bandwidth = best_tflops = 0.0
    for _ in range(runs):
        if between_runs is not None and not between_runs():
            break
        best_bandwidth = max(best_bandwidth, measure_bandwidth_gbs())
        best_tflops = max(best_tflops, measure_matmul_tflops())
    release_free_memory()  # the matmuls' operands: freed after a large free, glibc keeps them resident
    if best_bandwidth <= 0 or best_tflops <= 0:
        return None
    return record_cpu_peaks(CpuPeaks(best_bandwidth, best_tflops))


def record_cpu_peaks(measured: CpuPeaks) -> CpuPeaks:
    """Merge a measurement into the cache, figure by figure keeping the higher; returns the result."""
    cache = _read_cache()
    key = cpu_key()
    old = cached_cpu_peaks()
    merged = measured if old is None else CpuPeaks(max(old.bandwidth_gbs, measured.bandwidth_gbs),
                                                   max(old.bf16_tflops, measured.bf16_tflops))
    if merged != old:
        cache[key] = {"bandwidth_gbs": merged.bandwidth_gbs, "bf16_tflops": merged.bf16_tflops,
                      "measured_at": time.time()}
        try:
            path = cache_path()
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
    return merged


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measure_matmul_tflops(size: int = 2048, seconds: float = 0.2) -> float:
    """Best matmul TFLOP/s over `seconds` of repeats, in the engine's CPU dtype (bf16 where native)."""
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


def measure_bandwidth_gbs(megabytes: int | None = None, repeats: int = 3) -> float:
    """Memory bandwidth as a large copy sees it (bytes read + bytes written per second), best of
    repeats. The copy's source and target take `megabytes` each, by default just enough to miss
    the caches (bandwidth_probe_megabytes): they are resident while it runs."""
    import torch

    source = torch.ones((megabytes or bandwidth_probe_megabytes()) * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = max(best, 2 * source.numel() * 4 / (time.perf_counter() - start))
    return best / 1e9


def bandwidth_probe_megabytes() -> int:
    """Each copy buffer's size: twice the largest cache, at least 64 MB (a working set of 4x the
    cache reads the same as 16x here: Zen 5, 32 MB L3; 2x read ~10% high); 256 MB where the caches
    are unknown. Each buffer was 256 MB everywhere, a 0.5 GB jump in a server's RSS."""
    largest = largest_cache_bytes()
    return 256 if largest is None else max(64, -(-2 * largest // 2**20))


def largest_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The largest CPU cache sysfs lists for CPU 0 (the L3 where there is one), None if unknown."""
    sizes = []
    for entry in caches.glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            continue
    return max(sizes) if sizes else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
