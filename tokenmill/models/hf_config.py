"""HF config.json (+ generation_config.json) -> ModelConfig."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.models.registry import resolve_architecture


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def load_hf_config(model_dir: Path) -> ModelConfig:
    """The ModelConfig of an HF model directory (config.json, plus generation_config.json's EOS ids)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json")
    gen_path = model_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else None
    return parse_hf_config(_read_json(path), path, generation)


def load_hf_config_file(path: Path) -> ModelConfig:
    """The ModelConfig of a config.json file on its own (any name)."""
    return parse_hf_config(_read_json(path), path)


def parse_hf_config(cfg: dict, path: Path, generation: dict | None = None) -> ModelConfig:
    """A config.json's contents -> ModelConfig; `path` names the file in errors. Any malformed field
    is a ModelLoadError."""
    try:
        return _parse(cfg, path, generation)
    except (TypeError, AttributeError, ValueError, IndexError) as exc:  # a field of the wrong shape
        raise ModelLoadError(f"{path.name}: malformed config ({type(exc).__name__}: {exc})"[:300]) from None


def _parse(cfg: dict, path: Path, generation: dict | None) -> ModelConfig:
    archs = cfg.get("architectures") or [cfg.get("model_type")]
    arch = resolve_architecture(archs[0])
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported")
    # transformers 5 writes rope settings under rope_parameters; older configs use rope_theta/rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    rope_scaling = cfg.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    eos = _as_list(cfg.get("eos_token_id"))
    if generation is not None:
        eos += [t for t in _as_list(generation.get("eos_token_id")) if t not in eos]
    sliding_window = cfg.get("sliding_window")
    if arch == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding_window = None
    try:
        num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        head_dim = cfg.get("head_dim")
        if head_dim is None:
            if type(hidden) is not int or type(num_heads) is not int or num_heads < 1 or hidden % num_heads:
                raise ModelLoadError(f"{path}: hidden_size ({hidden!r}) must be a multiple of "
                                     f"num_attention_heads ({num_heads!r})")
            head_dim = hidden // num_heads
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_number(rope_theta, "rope_theta", path),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            sliding_window=sliding_window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path} lacks required field {exc.args[0]!r}") from exc
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path.name}: {exc.message}") from None


def _number(value, name: str, path: Path) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"{path}: {name} must be a number, got {value!r}"[:200]) from None
