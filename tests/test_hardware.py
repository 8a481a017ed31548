"""Catalog lookups and this CPU's measured peaks: best of short runs, cached per CPU, only ever raised."""

from __future__ import annotations

import pytest

from tokenmill import hardware
from tokenmill.hardware import CpuPeaks


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_busy_measurement_never_lowers_the_cache(cache_home):
    assert hardware.cached_cpu_peaks() is None
    assert hardware.record_cpu_peaks(CpuPeaks(24.0, 2.0)) == CpuPeaks(24.0, 2.0)
    # taken while the machine was busy: both figures lower, nothing changes
    assert hardware.record_cpu_peaks(CpuPeaks(14.0, 1.4)) == CpuPeaks(24.0, 2.0)
    assert hardware.cached_cpu_peaks() == CpuPeaks(24.0, 2.0)
    # a better figure replaces its own, the other stays
    assert hardware.record_cpu_peaks(CpuPeaks(30.0, 1.0)) == CpuPeaks(30.0, 2.0)
    assert hardware.cached_cpu_peaks() == CpuPeaks(30.0, 2.0)
    assert (cache_home / "cpu_peaks.json").is_file()


def test_cache_is_keyed_by_cpu_model_and_threads(cache_home, monkeypatch):
    import torch

    hardware.record_cpu_peaks(CpuPeaks(24.0, 2.0))
    monkeypatch.setattr(hardware, "_cpu_model", lambda: "Another CPU @ 1.0GHz")
    assert hardware.cached_cpu_peaks() is None
    monkeypatch.undo()
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(cache_home))
    assert hardware.cached_cpu_peaks() == CpuPeaks(24.0, 2.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert hardware.cached_cpu_peaks() is None
    finally:
        torch.set_num_threads(threads)


def test_measurement_keeps_the_best_run(cache_home, monkeypatch):
    bandwidths, tflops = iter([10.0, 24.0, 12.0]), iter([1.4, 0.5, 2.0])
    monkeypatch.setattr(hardware, "measure_bandwidth_gbs", lambda: next(bandwidths))
    monkeypatch.setattr(hardware, "measure_matmul_tflops", lambda: next(tflops))
    assert hardware.measure_cpu_peaks(runs=3) == CpuPeaks(24.0, 2.0)
    assert hardware.this_cpu().bandwidth_gbs == 24.0  # cached now: nothing measured again


def test_measurement_stops_when_asked_and_records_nothing(cache_home, monkeypatch):
    monkeypatch.setattr(hardware, "measure_bandwidth_gbs", lambda: pytest.fail("measured while busy"))
    assert hardware.measure_cpu_peaks(between_runs=lambda: False) is None
    assert hardware.cached_cpu_peaks() is None


def test_corrupt_cache_is_ignored(cache_home):
    path = cache_home / "cpu_peaks.json"
    path.write_text('{"' + hardware.cpu_key() + '": {"bandwidth_gbs": "fast"}}')
    assert hardware.cached_cpu_peaks() is None
    path.write_text("not json")
    assert hardware.cached_cpu_peaks() is None
    assert hardware.record_cpu_peaks(CpuPeaks(5.0, 0.5)) == CpuPeaks(5.0, 0.5)


def test_real_measurement_is_plausible(cache_home):
    peaks = hardware.measure_cpu_peaks(runs=1)
    assert 0.5 < peaks.bandwidth_gbs < 2000 and 0.001 < peaks.bf16_tflops < 100
    assert 0.0 <= hardware.machine_busy_fraction(0.05) <= 1.0


def test_the_bandwidth_probe_is_sized_by_the_largest_cache(tmp_path, monkeypatch):
    for index, size in enumerate(["48K", "1024K", "107520K", "junk"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert hardware.largest_cache_bytes(tmp_path) == 105 * 2**20
    assert hardware.largest_cache_bytes(tmp_path / "missing") is None
    for largest, megabytes in [(105 * 2**20, 210), (32 * 2**20, 64), (8 * 2**20, 64), (None, 256)]:
        monkeypatch.setattr(hardware, "largest_cache_bytes", lambda largest=largest: largest)
        assert hardware.bandwidth_probe_megabytes() == megabytes
