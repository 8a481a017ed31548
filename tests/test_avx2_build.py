"""The AVX2 build's tests, run on AVX-512 machines too.

CPUs without AVX-512 get their own extension (cpu_kernels.AVX2_SOURCES) and their own decode path;
its tests skip wherever the AVX-512 kernels load, so a change to them would otherwise be tested
only on the days CI lands on such a CPU. Here, on an AVX-512 CPU, those test files run in a
subprocess with ATEN_CPU_CAPABILITY=avx2: torch then dispatches as on an AVX2 CPU and our loader
builds and uses the AVX2 extension (compiled for this CPU: -march=native lets the compiler use
AVX-512 in its plain loops, which once exposed a sum whose rounding depended on where it was inlined).
On an AVX2 machine the same tests run in the suite itself, so this one skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.layers.cpu_kernels import AVX2_FLAGS, kernels_enabled
from tokenmill.platform import cpu_flags

TESTS = Path(__file__).parent
# the files whose tests need the AVX2 build (its kernels, its decode step, its tolerances)
AVX2_TEST_FILES = ["test_decode_attention_rows.py", "test_decode_plan.py", "test_fused_ops.py", "test_quantized.py",
                   "test_tensor_parallel.py", "test_invariance.py",
                   "test_default_model.py::test_default_path_follows_transformers_up_to_near_ties"]
# servers and launchers, whose processes the suite itself tests: ~40 s here with nothing of the AVX2 build's own
NOT_AVX2_SPECIFIC = ["test_tensor_parallel.py::test_server_tp3_on_the_default_model",
                     "test_tensor_parallel.py::test_torchrun_launch_is_the_same_code_path",
                     "test_tensor_parallel.py::test_server_ends_with_a_clear_error_when_a_worker_dies"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif("AVX512" not in torch.backends.cpu.get_cpu_capability() or not AVX2_FLAGS <= cpu_flags()
                       or not kernels_enabled(), reason="an AVX-512 CPU (on AVX2 CPUs these tests run directly)"),
]


def test_the_avx2_builds_tests_pass_on_this_cpu():
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    probe = subprocess.run(
        [sys.executable, "-c", "from tokenmill.layers import cpu_kernels as c; "
                               "print(c.load_cpu_kernels(), c.load_avx2_kernels(), c.decode_attention_rows_available())"],
        env=env, capture_output=True, text=True, timeout=600)
    # the AVX-512 extension declines, the AVX2 one builds: the files below run the AVX2 paths
    assert probe.stdout.split() == ["False", "True", "True"], probe.stdout + probe.stderr[-2000:]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(TESTS / f) for f in AVX2_TEST_FILES),
         *(f"--deselect={TESTS.name}/{test}" for test in NOT_AVX2_SPECIFIC)],
        env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
