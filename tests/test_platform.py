"""platform.py: the dtype that "auto" picks for each kind of CPU."""

from __future__ import annotations

import pytest
import torch

from tokenmill import platform
from tokenmill.errors import InvalidParameterError

CPU = torch.device("cpu")
ZEN5 = {"avx512f", "avx512_vnni", "avx512_bf16"}  # AVX-512 BF16 (the AMD EPYC here; AMX Xeons too)
ICE_LAKE = {"avx512f", "avx512_vnni"}  # VNNI without bf16 arithmetic (Ice Lake, Cascade Lake)
AVX2 = {"avx2", "fma", "f16c"}


@pytest.fixture
def cpu_like(monkeypatch):
    """Make platform see a CPU with these flags and torch run its AVX-512 code (or AVX2's)."""
    def pretend(flags: set[str]) -> None:
        monkeypatch.setattr(platform, "cpu_flags", lambda: flags)
        capability = "AVX512" if "avx512f" in flags else "AVX2"
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    return pretend


@pytest.mark.parametrize("flags,dense,quantized", [
    (ZEN5, torch.bfloat16, torch.bfloat16),
    (ICE_LAKE, torch.float32, torch.bfloat16),  # the int8 kernels take bf16 rows; dense matmuls want float32
    (AVX2, torch.float32, torch.float32),
])
def test_auto_dtype_follows_the_cpu_and_the_weights(cpu_like, flags, dense, quantized):
    cpu_like(flags)
    assert platform.resolve_dtype("auto", CPU) == dense
    assert platform.resolve_dtype("auto", CPU, quantized_weights=True) == quantized
    assert platform.resolve_dtype("float32", CPU, quantized_weights=True) == torch.float32  # asked for: kept
    assert platform.resolve_dtype(torch.bfloat16, CPU) == torch.bfloat16


def test_avx512_vnni_under_an_avx2_torch_keeps_float32(cpu_like, monkeypatch):
    """ATEN_CPU_CAPABILITY=avx2 picks our AVX2 kernels, which take float32 rows."""
    cpu_like(ICE_LAKE)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert platform.resolve_dtype("auto", CPU, quantized_weights=True) == torch.float32


def test_unknown_dtype_is_refused():
    with pytest.raises(InvalidParameterError, match="dtype must be one of"):
        platform.resolve_dtype("float8", CPU)
