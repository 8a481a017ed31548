"""Shared fixtures: the default model's tokenizer, tiny random HF models, the default model.

Each expensive thing is built once per test session.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# CI replays the same property-test examples every run; locally hypothesis explores afresh.
if os.environ.get("CI"):
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    settings.load_profile("ci")

TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The default model's tokenizer (built from its GGUF once), saved as HF files.

    TOKENMILL_TEST_TOKENIZER_DIR names a saved copy instead, for machines without the default
    model (a GPU box that cannot install it).
    """
    from tokenmill.models.model_files import default_model_path, load_tokenizer

    if os.environ.get("TOKENMILL_TEST_TOKENIZER_DIR"):
        return Path(os.environ["TOKENMILL_TEST_TOKENIZER_DIR"])
    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(default_model_path()).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _hf_config(arch: str):
    import transformers

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # peaked logits: greedy ties between top tokens are vanishingly rare
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":  # untied, llama3 rope scaling
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )
    if arch == "mistral":  # untied, no sliding window
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen2":  # tied, qkv bias
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # tied, q/k norm, head_dim != hidden / heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    raise ValueError(arch)


def build_tiny_model(arch: str, path: Path, tokenizer_dir: Path) -> Path:
    """A random-weight HF model of the given family, saved as safetensors with the tokenizer."""
    import transformers

    torch.manual_seed(1234)
    config = _hf_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # defaults are 0 / 1: randomise so loading is checked
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    return {arch: build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), tokenizer_dir) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    """One engine on the tiny Llama for tests that only need *a* model."""
    from tokenmill import LLM

    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="session")
def default_llm():
    """The default model (SmolLM2-135M-Instruct Q4_1 GGUF) in float32."""
    from tokenmill import LLM

    return LLM(dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module")
def client(server):
    """The official openai SDK talking to the module's `server` fixture (a real `tokenmill serve`)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    """The model name that server serves."""
    return client.models.list().data[0].id
