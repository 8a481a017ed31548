"""Decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3.

The families differ only in flags of ModelConfig: bias on q/k/v (Qwen2), per-head
q/k RMSNorm (Qwen3), tied embeddings. Q/K/V and gate/up projections are fused into
one matmul each; load_weights maps HF checkpoint names onto the fused weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.layers.attention import AttentionContext
from tokenmill.layers.linear import silu_and_mul
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedWeight, concat_rows
from tokenmill.layers.rotary import RopeStep, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.has_qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.has_o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, rope: RopeStep, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # x: [T, hidden]
        qkv = self.qkv_proj(x)
        num_tokens = qkv.shape[0]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k are adjacent in the fused output: rotate both with one set of ops
            qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            qk = rope.rotate(qk)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        else:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rope.rotate(q), rope.rotate(k)
        out = ctx.attend(self.layer_index, q, k, v, self.scale)  # [T, num_heads * head_dim]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj, x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, rope: RopeStep, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings at layer 0); residual: the sum of
        everything before it (None at layer 0), added to in place. Returns this layer's MLP output
        and the residual, so that each add is fused into the RMSNorm after it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, ctx), residual)
        return self.mlp(h), residual


class DecoderForCausalLM(nn.Module):
    """Embeddings -> decoder layers -> norm; logits only for the rows asked for."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        # an explicit (uninitialised) weight: nn.Embedding's own random init would import
        # torch._dynamo on the meta device (~1 s of start-up); load_weights fills it
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, hidden]
        x = self.embed_tokens(input_ids)
        rope = self.rotary.step(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, ctx)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> float32 logits [N, vocab]
        if self.lm_head is None:  # tied
            return F.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def untie_lm_head(self) -> None:
        """Give a tied model an lm_head module that shares the embedding tensor (so it can be swapped)."""
        if self.lm_head is None:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; every one must be filled.
        Quantized weights (a GGUF's) replace their layer by its quantized form instead; a fused
        layer whose parts are not all quantized gets them all dequantized."""
        params = dict(self.named_parameters())
        filled: dict[str, int] = {}
        quantized: dict[str, list[tuple[int, QuantizedWeight]]] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store a copy
            target, offset = _fused_target(name, self.config)
            if target not in params:
                raise ModelLoadError(f"unexpected weight {name!r} in checkpoint")
            param = params[target]
            rows = tensor.shape[0]
            expected = param.shape if offset is None else (rows, *param.shape[1:])
            if tuple(tensor.shape) != tuple(expected) or (offset or 0) + rows > param.shape[0]:
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)}")
            if isinstance(tensor, QuantizedWeight):
                quantized.setdefault(target, []).append((offset or 0, tensor))
            else:
                (param.data if offset is None else param.data.narrow(0, offset, rows)).copy_(tensor)
            filled[target] = filled.get(target, 0) + (rows if offset is not None else param.shape[0])
        missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
        for target, parts in quantized.items():
            if sum(p.shape[0] for _, p in parts) != params[target].shape[0]:  # some parts were plain tensors
                for offset, part in parts:
                    params[target].data.narrow(0, offset, part.shape[0]).copy_(part.dequantize())
            else:
                self._use_quantized(target, concat_rows([p for _, p in sorted(parts, key=lambda item: item[0])]))

    def _use_quantized(self, param_name: str, qweight: QuantizedWeight) -> None:
        """Swap the layer owning `param_name` for its quantized form (the tied head shares the table)."""
        module_path = param_name.removesuffix(".weight")
        parent_path, _, attr = module_path.rpartition(".")
        parent = self.get_submodule(parent_path) if parent_path else self
        old = getattr(parent, attr)
        qweight = qweight.to(old.weight.device)  # read to the CPU; the model may live on a GPU
        if isinstance(old, nn.Embedding):
            setattr(parent, attr, QuantizedEmbedding(qweight, old.weight.dtype))
            if self.lm_head is None:
                self.lm_head = QuantizedLinear(qweight)
        else:
            setattr(parent, attr, QuantizedLinear(qweight, None if old.bias is None else old.bias.data))


def _fused_target(name: str, config: ModelConfig) -> tuple[str, int | None]:
    """Map an HF parameter name to (our parameter name, row offset into the fused weight)."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    fused = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", q_size),
        "v_proj": ("qkv_proj", q_size + kv_size),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", config.intermediate_size),
    }
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in fused:
            new, offset = fused[part]
            return ".".join(parts[:i] + [new] + parts[i + 1 :]), offset
    return name, None
