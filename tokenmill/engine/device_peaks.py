"""The device's peak FLOP/s and memory bandwidth: the denominators of MFU and MBU.

Figures the user gives win; a known GPU takes its catalog entry; a CPU takes its cached
measurement (tokenmill.hardware). Nothing is measured on the way to serving: once per start a
CPU is measured in the background, in short runs taken only while the engine is idle and the
machine quiet, and the figures are filled in (or raised: a measurement never lowers the cache)
when that is done. Until a CPU has a measurement, MFU and MBU are undefined.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill import hardware

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

IDLE_SECONDS_BEFORE_MEASURING = 2.0
MAX_BUSY_FRACTION = 0.15  # of all CPUs: above this, other programs would lower the figures


@dataclass
class DevicePeaks:
    """Peaks shared by the metrics readers and the background measurement (which may fill them in)."""

    flops: float | None = None  # FLOP/s
    bandwidth: float | None = None  # bytes/s
    given: bool = False  # both came from the user: never measured


def known_peaks(device: torch.device, peak_tflops: float | None = None,
                peak_bandwidth_gbs: float | None = None) -> DevicePeaks:
    """The peaks known without measuring anything."""
    tflops, gbs = peak_tflops, peak_bandwidth_gbs
    if tflops is None or gbs is None:
        if device.type == "cuda":
            import torch

            entry = hardware.match_cuda_device(torch.cuda.get_device_name(device))
            known = None if entry is None else (entry.bf16_tflops, entry.bandwidth_gbs)
        else:
            cached = hardware.cached_cpu_peaks()
            known = None if cached is None else (cached.bf16_tflops, cached.bandwidth_gbs)
        if known is not None:
            tflops = known[0] if tflops is None else tflops
            gbs = known[1] if gbs is None else gbs
    return DevicePeaks(None if tflops is None else tflops * 1e12, None if gbs is None else gbs * 1e9,
                       given=peak_tflops is not None and peak_bandwidth_gbs is not None)


class PeakProbe(threading.Thread):
    """The background measurement; stop() ends it between two short runs and waits for it."""

    def __init__(self, run: Callable[[], None], stopping: threading.Event) -> None:
        super().__init__(target=run, name="tokenmill-peaks")
        self.stopping = stopping

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping.set()
        self.join(timeout)


def measure_cpu_when_idle(peaks: DevicePeaks, is_idle: Callable[[], bool], peak_tflops: float | None = None,
                          peak_bandwidth_gbs: float | None = None,
                          on_measured: Callable[[DevicePeaks], None] | None = None) -> PeakProbe | None:
    """Unless both figures are given: start a thread that measures this CPU once the engine has been
    idle for a while and the machine is quiet (each short run only while both still hold), records
    the result and fills in the figures not given (then calls on_measured(peaks) on that thread).
    Stop it before the process exits."""
    if peaks.given:
        return None
    stopping = threading.Event()

    def idle() -> bool:
        return not stopping.is_set() and is_idle()

    def quiet() -> bool:
        return idle() and hardware.machine_busy_fraction() <= MAX_BUSY_FRACTION and idle()

    def run() -> None:
        while not stopping.is_set():
            idle_since = time.monotonic()
            while idle():
                if time.monotonic() - idle_since >= IDLE_SECONDS_BEFORE_MEASURING and quiet():
                    measured = hardware.measure_cpu_peaks(between_runs=quiet)
                    if measured is None:  # work arrived before the first run: wait for the next lull
                        break
                    if peak_tflops is None:
                        peaks.flops = measured.bf16_tflops * 1e12
                    if peak_bandwidth_gbs is None:
                        peaks.bandwidth = measured.bandwidth_gbs * 1e9
                    logger.info("CPU peaks: %.2f TFLOP/s, %.1f GB/s", measured.bf16_tflops, measured.bandwidth_gbs)
                    if on_measured is not None:
                        on_measured(peaks)
                    return
                stopping.wait(0.1)
            stopping.wait(0.5)

    probe = PeakProbe(run, stopping)
    probe.start()
    return probe
