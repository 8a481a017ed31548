"""`tokenmill generate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from tokenmill import LLM, SamplingParams


def _run(*args):
    return subprocess.run([sys.executable, "-m", "tokenmill.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_streams_greedy_text(tiny_llama_dir):
    result = _run("generate", "Once upon a time", "--model", str(tiny_llama_dir), "--max-tokens", "8",
                  "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    expected = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16).generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"


def test_generate_errors_are_one_line(tiny_llama_dir, tmp_path):
    too_long = _run("generate", "hi", "--model", str(tiny_llama_dir), "--max-tokens", "100000")
    assert too_long.returncode == 2
    assert too_long.stderr.strip().splitlines()[-1].startswith("tokenmill: error: prompt (")
    assert "max_model_len (512)" in too_long.stderr and "Traceback" not in too_long.stderr
    missing = _run("generate", "hi", "--model", str(tmp_path / "missing"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_generate_keeps_a_16_bit_kv_cache_when_asked(tiny_llama_dir):
    half = _run("generate", "Once upon a time", "--model", str(tiny_llama_dir), "--max-tokens", "8",
                "--dtype", "float32", "--kv-cache-dtype", "float16")
    assert half.returncode == 0, half.stderr
    expected = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, kv_cache_dtype="float16").generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert half.stdout == expected + "\n"
    refused = _run("generate", "hi", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "--kv-cache-dtype", "float16")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("tokenmill: error: a bfloat16 model keeps its own KV")
