"""Which architectures tokenmill runs, by their HF and GGUF names."""

from __future__ import annotations

from tokenmill.errors import ModelLoadError

# HF `architectures[0]` / `model_type` / GGUF `general.architecture` -> our family name
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}

# llama.cpp stores Q/K of these families permuted for its interleaved rope.
GGUF_PERMUTED_QK = {"llama", "mistral"}


def resolve_architecture(name: str | None) -> str:
    if isinstance(name, str) and name in _ARCHITECTURES:
        return _ARCHITECTURES[name]
    supported = sorted({v for v in _ARCHITECTURES.values()})
    raise ModelLoadError(f"unsupported architecture {repr(name)[:80]}; tokenmill runs: {', '.join(supported)}")
