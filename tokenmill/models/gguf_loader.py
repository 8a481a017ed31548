"""Read a llama.cpp GGUF file: config from metadata, tensors repacked (quantized) or dequantized
via `gguf` (the container itself: models/gguf_format.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.layers.quantized import QuantizedWeight
from tokenmill.models.gguf_format import GGUFContents, GGUFFormatError, StringArray
from tokenmill.models.gguf_quants import QUANTIZED_TYPES, repack
from tokenmill.models.registry import GGUF_PERMUTED_QK, resolve_architecture

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFFile:
    """An opened GGUF file; raises ModelLoadError if it is not a readable GGUF."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.contents = GGUFContents(path)
        except (GGUFFormatError, OSError) as exc:
            raise ModelLoadError(f"{path.name} is not a readable GGUF file: {exc}") from exc
        self.tensor_names = {t.name for t in self.contents.tensors}

    def metadata(self, key: str, default=None):
        value = self.contents.metadata.get(key, default)
        return value.decode() if isinstance(value, StringArray) else value

    def model_config(self) -> ModelConfig:
        arch_name = self.metadata("general.architecture")
        arch = resolve_architecture(arch_name)

        def number(suffix: str, default=None, kind=int):
            value = self.metadata(f"{arch_name}.{suffix}", default)
            if value is None:
                raise ModelLoadError(f"{self.path.name} lacks metadata {arch_name}.{suffix}")
            try:
                return kind(value)
            except (TypeError, ValueError, OverflowError):
                raise ModelLoadError(f"{self.path.name}: metadata {arch_name}.{suffix} must be a number, "
                                     f"got {repr(value)[:80]}") from None

        num_heads = number("attention.head_count")
        hidden = number("embedding_length")
        if num_heads < 1 or hidden % num_heads:
            raise ModelLoadError(f"{self.path.name}: embedding_length ({hidden}) must be a multiple of "
                                 f"attention.head_count ({num_heads})")
        vocab = self.metadata(f"{arch_name}.vocab_size")
        if vocab is None:
            vocab = len(self.contents.metadata.get("tokenizer.ggml.tokens", ()))
        rope_scaling = None
        if "rope_freqs.weight" in self.tensor_names:
            factors = self._tensor("rope_freqs.weight").tolist()
            rope_scaling = {"rope_type": "freq_factors", "factors": factors}
        eos = self.metadata("tokenizer.ggml.eos_token_id")
        try:
            return ModelConfig(
                architecture=arch,
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=number("feed_forward_length"),
                num_hidden_layers=number("block_count"),
                num_attention_heads=num_heads,
                num_key_value_heads=number("attention.head_count_kv", num_heads),
                head_dim=number("attention.key_length", hidden // num_heads),
                rms_norm_eps=number("attention.layer_norm_rms_epsilon", 1e-6, float),
                rope_theta=number("rope.freq_base", 10000.0, float),
                rope_scaling=rope_scaling,
                max_position_embeddings=number("context_length", 4096),
                tie_word_embeddings="output.weight" not in self.tensor_names,
                qk_norm=arch == "qwen3",
                bos_token_id=self.metadata("tokenizer.ggml.bos_token_id"),
                eos_token_ids=[] if eos is None else [int(eos)],
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path.name}: {exc.message}") from None
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{self.path.name}: malformed metadata ({exc})"[:300]) from None

    def _tensor(self, name: str) -> np.ndarray:
        import gguf

        for t in self.contents.tensors:
            if t.name == name:
                try:
                    array = gguf.quants.dequantize(t.data, t.tensor_type)
                except Exception as exc:
                    raise ModelLoadError(f"cannot dequantize {name} ({t.tensor_type.name}): {exc}") from exc
                return array.reshape([int(d) for d in reversed(t.shape)])
        raise ModelLoadError(f"{self.path.name} has no tensor {name}")

    def iter_tensors(self, config: ModelConfig, keep_quantized: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Yield (HF name, float32 tensor) with llama.cpp's Q/K permutation undone; with
        keep_quantized, matrices of the quantized types come as QuantizedWeight instead (repacked,
        not dequantized)."""
        for t in self.contents.tensors:
            if t.name == "rope_freqs.weight":
                continue
            hf_name = _hf_name(t.name)
            if hf_name is None:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in {self.path.name}")
            shape = [int(d) for d in reversed(t.shape)]
            if keep_quantized and len(shape) == 2 and t.tensor_type.name in QUANTIZED_TYPES:
                try:
                    tensor = repack(t.data, t.tensor_type.name, (shape[0], shape[1]))
                except ValueError as exc:
                    raise ModelLoadError(f"{self.path.name}: cannot repack {t.name} ({t.tensor_type.name}): {exc}"
                                         ) from None
            else:
                tensor = torch.from_numpy(np.array(self._tensor(t.name), dtype=np.float32, copy=True))
            if config.architecture in GGUF_PERMUTED_QK:
                if hf_name.endswith("q_proj.weight"):
                    tensor = _unpermute_rows(tensor, config.num_attention_heads)
                elif hf_name.endswith("k_proj.weight"):
                    tensor = _unpermute_rows(tensor, config.num_key_value_heads)
            yield hf_name, tensor


def _unpermute_rows(tensor: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(tensor, QuantizedWeight):
        return tensor.rows(_unpermute(torch.arange(tensor.shape[0]), num_heads))
    return _unpermute(tensor, num_heads)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head interleaving of the rotary halves (rows of Q or K)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )
