"""What a model costs per token, from its config alone: parameters, weight bytes, KV bytes, FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# Weight-only quantization: bytes per weight including one fp16 scale per group of 32 (int8) / 64 (int4).
QUANT_BYTES = {"int8": 1.0 + 2 / 32, "int4": 0.5 + 2 / 64}


@dataclass(frozen=True)
class ModelMath:
    """Per-token costs of one decoder model."""

    config: ModelConfig

    @property
    def num_layer_params(self) -> int:
        c = self.config
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
        if c.has_qkv_bias:
            attention += q + 2 * kv
        if c.has_o_bias:
            attention += c.hidden_size
        mlp = 3 * c.hidden_size * c.intermediate_size
        norms = 2 * c.hidden_size + (2 * c.head_dim if c.qk_norm else 0)
        return attention + mlp + norms

    @property
    def num_params(self) -> int:
        """All parameters (embeddings counted once when tied)."""
        c = self.config
        embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        return c.num_hidden_layers * self.num_layer_params + embeddings + c.hidden_size

    @property
    def num_matmul_params(self) -> int:
        """Parameters multiplied per token: every layer plus the LM head (the embedding is a lookup)."""
        c = self.config
        return c.num_hidden_layers * self.num_layer_params + c.vocab_size * c.hidden_size

    def weight_bytes(self, dtype: str = "bfloat16", weight_quant: str | None = None) -> float:
        """Bytes of all weights; with weight_quant the layers' linear weights are quantized."""
        element = _dtype_bytes(dtype)
        if weight_quant is None:
            return self.num_params * element
        if weight_quant not in QUANT_BYTES:
            raise InvalidParameterError(f"weight_quant must be one of {sorted(QUANT_BYTES)}", param="weight_quant")
        c = self.config
        linear = c.num_hidden_layers * (self.num_layer_params - 2 * c.hidden_size)
        return linear * QUANT_BYTES[weight_quant] + (self.num_params - linear) * element

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> float:
        return self.config.kv_bytes_per_token(_dtype_bytes(dtype))

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query attending to one position: QK^T and PV over every head and layer."""
        c = self.config
        return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim

    def flops_per_token(self, context_len: int = 0) -> float:
        """Forward FLOPs of one token attending to context_len earlier tokens."""
        return 2 * self.num_matmul_params + self.attention_flops_per_pair * context_len


def _dtype_bytes(dtype: str) -> float:
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPE_BYTES:
        raise InvalidParameterError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}", param="dtype")
    return DTYPE_BYTES[dtype]
