"""MFU/MBU denominators: given, cached, or measured in the background only while the engine idles."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tokenmill import hardware
from tokenmill.engine import device_peaks
from tokenmill.engine.device_peaks import DevicePeaks, known_peaks, measure_cpu_when_idle
from tokenmill.hardware import CpuPeaks

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(device_peaks, "IDLE_SECONDS_BEFORE_MEASURING", 0.2)
    monkeypatch.setattr(hardware, "machine_busy_fraction", lambda: 0.0)  # the test machine is quiet


def _fake_measurements(monkeypatch, log: list[float]) -> None:
    def bandwidth():
        log.append(time.monotonic())
        return 20.0

    monkeypatch.setattr(hardware, "measure_bandwidth_gbs", bandwidth)
    monkeypatch.setattr(hardware, "measure_matmul_tflops", lambda: 1.5)


def test_known_peaks_never_measure(monkeypatch):
    monkeypatch.setattr(hardware, "measure_cpu_peaks", lambda **kw: pytest.fail("measured on the path to ready"))
    monkeypatch.setattr(hardware, "machine_busy_fraction", lambda: pytest.fail("measured on the path to ready"))
    assert known_peaks(CPU) == DevicePeaks(None, None)
    assert known_peaks(CPU, peak_tflops=2.0) == DevicePeaks(2e12, None)
    hardware.record_cpu_peaks(CpuPeaks(24.0, 2.0))
    assert known_peaks(CPU) == DevicePeaks(2e12, 24e9)
    assert known_peaks(CPU, 1.0, 5.0) == DevicePeaks(1e12, 5e9, given=True)


def test_measures_only_while_idle_and_fills_the_figures(monkeypatch):
    runs: list[float] = []
    _fake_measurements(monkeypatch, runs)
    busy_until = time.monotonic() + 0.5
    peaks = DevicePeaks()
    thread = measure_cpu_when_idle(peaks, lambda: time.monotonic() >= busy_until, peak_bandwidth_gbs=50.0)
    thread.join(10)
    assert not thread.is_alive()
    assert runs and min(runs) >= busy_until + 0.2  # after the engine had been idle for a while
    assert peaks.flops == 1.5e12 and peaks.bandwidth is None  # a given figure is never replaced
    assert hardware.cached_cpu_peaks() == CpuPeaks(20.0, 1.5)


def test_given_figures_are_never_measured():
    assert measure_cpu_when_idle(DevicePeaks(1.0, 1.0, given=True), lambda: True) is None


def test_a_cached_figure_is_only_raised(monkeypatch):
    hardware.record_cpu_peaks(CpuPeaks(24.0, 2.0))
    runs: list[float] = []
    _fake_measurements(monkeypatch, runs)  # 20 GB/s, 1.5 TFLOP/s: both below the cache
    peaks = known_peaks(CPU)
    measure_cpu_when_idle(peaks, lambda: True).join(10)
    assert runs and peaks == DevicePeaks(2e12, 24e9) and hardware.cached_cpu_peaks() == CpuPeaks(24.0, 2.0)


def test_a_busy_machine_defers_the_measurement(monkeypatch):
    runs: list[float] = []
    _fake_measurements(monkeypatch, runs)
    quiet_after = time.monotonic() + 0.6
    monkeypatch.setattr(hardware, "machine_busy_fraction", lambda: 0.0 if time.monotonic() > quiet_after else 0.9)
    measure_cpu_when_idle(DevicePeaks(), lambda: True).join(10)
    assert runs and min(runs) >= quiet_after  # another program's load came first


def test_work_arriving_stops_the_runs(monkeypatch):
    runs: list[float] = []
    _fake_measurements(monkeypatch, runs)
    idle = threading.Event()
    idle.set()
    peaks = DevicePeaks()

    def is_idle() -> bool:
        if runs:  # the first run started: work arrives
            idle.clear()
        return idle.is_set()

    measure_cpu_when_idle(peaks, is_idle).join(10)
    assert len(runs) == 1  # one run started while idle; none after the engine got busy
    assert peaks.flops == 1.5e12  # what was measured counts
