"""Malformed model files: truncated, corrupted header, metadata and tensor infos, huge counts and
dims, zero heads, wrong types in config.json. Each is one typed, one-line ModelLoadError within a
few seconds: never a hang, never a traceback."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager

import gguf
import pytest
import torch
from test_gguf import write_tiny_gguf

from tokenmill.errors import ModelLoadError
from tokenmill.models.loader import load_model

CPU = torch.device("cpu")
SECONDS = 10


@contextmanager
def time_limit(seconds: int):
    def hung(signum, frame):
        raise TimeoutError(f"still loading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _expect_load_error(path, words: list[str]) -> str:
    with time_limit(SECONDS), pytest.raises(ModelLoadError) as info:
        load_model(str(path), torch.float32, CPU)
    message = info.value.message
    assert "\n" not in message and len(message) < 600, message
    for word in words:
        assert word in message, message
    return message


# ---- GGUF -----------------------------------------------------------------------------------
def _set_field(reader: gguf.GGUFReader, key: str, value) -> None:
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value


def _patch_header(offset: int, data: bytes):
    def mutate(path):
        raw = bytearray(path.read_bytes())
        raw[offset:offset + len(data)] = data
        path.write_bytes(bytes(raw))
    return mutate


def _metadata(key: str, value):
    def mutate(path):
        _set_field(gguf.GGUFReader(str(path), "r+"), key, value)
    return mutate


def _tensor_info(part: int, value, tensor: int = 3):
    def mutate(path):
        field = gguf.GGUFReader(str(path), "r+").tensors[tensor].field
        field.parts[part][...] = value
    return mutate


def _truncate(fraction: float):
    def mutate(path):
        raw = path.read_bytes()
        path.write_bytes(raw[: int(len(raw) * fraction)])
    return mutate


GGUF_MUTANTS = {
    # truncations
    "empty": (_truncate(0.0), []),
    "header only": (_truncate(0.0005), []),
    "cut at 30%": (_truncate(0.3), []),
    "cut at 90%": (_truncate(0.9), []),
    # header
    "bad magic": (_patch_header(0, b"GGUX"), []),
    "version 99": (_patch_header(4, (99).to_bytes(4, "little")), []),
    "huge tensor count": (_patch_header(8, (2**62).to_bytes(8, "little")), []),
    "huge metadata count": (_patch_header(16, (2**62).to_bytes(8, "little")), []),
    # metadata: huge counts and dims, zero heads
    "block_count 0xFFFFFFFF": (_metadata("llama.block_count", 0xFFFFFFFF), ["num_hidden_layers"]),
    "block_count 0": (_metadata("llama.block_count", 0), ["num_hidden_layers"]),
    "head_count 0": (_metadata("llama.attention.head_count", 0), ["head_count"]),
    "head_count_kv 0": (_metadata("llama.attention.head_count_kv", 0), ["num_key_value_heads"]),
    "head_count_kv 3": (_metadata("llama.attention.head_count_kv", 3), ["num_key_value_heads", "divide"]),
    "embedding_length huge": (_metadata("llama.embedding_length", 0xFFFFFFF0), ["hidden_size"]),
    "embedding_length not a multiple": (_metadata("llama.embedding_length", 257), ["multiple"]),
    "context_length huge": (_metadata("llama.context_length", 0xFFFFFFFF), ["max_position_embeddings"]),
    "feed_forward_length huge": (_metadata("llama.feed_forward_length", 0xFFFFFFFF), ["intermediate_size"]),
    "vocab_size 0": (_metadata("llama.vocab_size", 0), ["vocab_size"]),
    "rope base 0": (_metadata("llama.rope.freq_base", 0.0), ["rope_theta"]),
    # tensor infos
    "tensor dims huge": (_tensor_info(3, 2**40), []),
    "tensor n_dims huge": (_tensor_info(2, 1000), []),
    "tensor type unknown": (_tensor_info(4, 200), []),
    "tensor offset past the end": (_tensor_info(5, 2**50), []),
    "tensor shape wrong": (_tensor_info(3, 64), []),
}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    return path


@pytest.mark.parametrize("name", list(GGUF_MUTANTS))
def test_gguf_mutants_are_one_clean_error(name, tiny_gguf, tmp_path):
    mutate, words = GGUF_MUTANTS[name]
    path = tmp_path / "mutant.gguf"
    shutil.copy(tiny_gguf, path)
    mutate(path)
    message = _expect_load_error(path, words)
    assert "tokenizer" not in message  # it failed on the mutation, before the (absent) tokenizer


def test_the_unmutated_tiny_gguf_gets_as_far_as_the_tokenizer(tiny_gguf):
    _expect_load_error(tiny_gguf, ["tokenizer"])  # so each mutant above fails for its own reason


# ---- HF config.json ---------------------------------------------------------------------------
CONFIG_MUTANTS = {
    "num_hidden_layers 10**9": ({"num_hidden_layers": 10**9}, ["num_hidden_layers"]),
    "hidden_size a string": ({"hidden_size": "sixty-four"}, ["hidden_size"]),
    "hidden_size a float": ({"hidden_size": 64.5}, ["hidden_size"]),
    "num_attention_heads 0": ({"num_attention_heads": 0}, ["num_attention_heads"]),
    "heads not dividing hidden": ({"num_attention_heads": 5, "num_key_value_heads": 5, "head_dim": None},
                                  ["multiple"]),
    "num_key_value_heads 3": ({"num_key_value_heads": 3}, ["num_key_value_heads"]),
    "vocab_size negative": ({"vocab_size": -1}, ["vocab_size"]),
    "intermediate_size huge": ({"intermediate_size": 10**30}, ["intermediate_size"]),
    "max_position_embeddings huge": ({"max_position_embeddings": 2**40}, ["max_position_embeddings"]),
    "head_dim odd": ({"head_dim": 7}, ["head_dim"]),
    "rope_theta a word": ({"rope_theta": "fast"}, ["rope_theta"]),
    "rope_scaling incomplete": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["rope_scaling"]),
    "rope_scaling a list": ({"rope_scaling": [1, 2]}, []),
    "rope_parameters a list": ({"rope_theta": None, "rope_parameters": [1]}, []),
    "eos_token_id a word": ({"eos_token_id": "end"}, ["eos_token_ids"]),
    "architectures a number": ({"architectures": 5}, []),
    "architectures a list of lists": ({"architectures": [["LlamaForCausalLM"]]}, ["unsupported architecture"]),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-5}, ["rms_norm_eps"]),
    "too big for memory": ({"hidden_size": 65536, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
                            "num_attention_heads": 512, "num_key_value_heads": 512}, ["needs", "available"]),
}


@pytest.mark.parametrize("name", list(CONFIG_MUTANTS))
def test_config_mutants_are_one_clean_error(name, tiny_llama_dir, tmp_path):
    changes, words = CONFIG_MUTANTS[name]
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    _expect_load_error(model, words)


def test_the_cli_reports_a_mutant_in_one_line(tiny_gguf, tmp_path):
    path = tmp_path / "mutant.gguf"
    shutil.copy(tiny_gguf, path)
    _metadata("llama.block_count", 0xFFFFFFFF)(path)
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "hi", "--model", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("tokenmill: error:")
    assert "num_hidden_layers" in result.stderr
