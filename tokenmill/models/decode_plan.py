"""The few-row decode step of a DecoderForCausalLM as one flat loop over bound kernel calls.

At decode with a handful of sequences every matrix is small, and the ~10 kernel calls a layer
makes each come with a few microseconds of Python: module calls, the checks that pick a path,
views. On the default model that was ~1.6 ms of a ~6 ms forward (one stream). A DecodePlan
makes those choices once, when it is built, and keeps per layer only what the calls need: the
CPU's stand-in for capturing a step in a CUDA graph. It computes what DecoderForCausalLM.forward
computes, with the same kernels in the same order (tests compare the two bit for bit), for CPU
decode steps of at most GEMV_MAX_ROWS sequences on our kernels: the AVX-512 set with its paged
attention, or the AVX2 build's fused ops with the PyTorch backend (whose decode is one op there);
every other step takes the model's forward. Linears whose layer has no bare few-row kernel
(dense, tensor-parallel) are called as the modules they are.

Where every projection of every layer runs the VNNI kernel and attention is the paged kernel's
(Llama-style layers without biases or q/k norms: the default model), the whole loop over the
layers is one call of csrc/decode_step.cpp's DecodeLayers: the same row functions in the same order,
in one parallel region, so the threads are not forked and joined around every call
(TOKENMILL_DECODE_LAYERS=0 keeps the Python loop, for comparisons). The AVX2 build has its own:
for a float32 model whose projections all run quant_gemv_i8 over the row layout, with the PyTorch
backend's caches, csrc/decode_step_avx2.cpp's DecodeLayersRows (1.2-1.5x the loop's W1 decode on
the 2-core EPYC).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.layers.attention import (
    ROWS_MAX_QUERY_GROUPS, AttentionContext, DecodeBucket, TorchPagedAttention, fused_decode_attention_rows,
)
from tokenmill.layers.cpu_attention import CpuPagedAttention, KernelDecodeBucket, fused_decode_attention
from tokenmill.layers.cpu_kernels import decode_attention_rows_available, fused_ops_available, kernels_available
from tokenmill.layers.linear import silu_and_mul
from tokenmill.layers.quantized import GEMV_MAX_ROWS, InterleavedWeight, QuantizedLinear, QuantizedWeight
from tokenmill.models.llama import DecoderForCausalLM

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LayerPlan:
    """One decoder layer: its weights and caches, its linears as plain callables."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    gate_up_is_kernel: bool  # gate_up's output goes to the fused SiLU op (else the module fuses it)
    gate_up_module: nn.Module
    q_norm: nn.Module | None  # Qwen3's per-head norms
    k_norm: nn.Module | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def _bound_linear(module: nn.Module) -> tuple[Linear, bool]:
    """(a callable computing module(x) for few rows, whether it is the bare kernel call)."""
    kernel = module.few_row_kernel() if isinstance(module, QuantizedLinear) else None
    return (module, False) if kernel is None else (kernel, True)


class FusedLayers:
    """Every layer's few-row decode step as one call of a fused step, which holds (and checked once)
    per layer its two norm weights, each projection's codes, scales and offsets with 4 ints (bits,
    group size, rows, 16-bit activations), and its caches: csrc/decode_step.cpp's DecodeLayers for
    the VNNI kernel and the paged kernel's caches, or on the AVX2 build decode_step_avx2.cpp's
    DecodeLayersRows for the row layout and the PyTorch backend's caches. Where the model's head runs
    the same kernel (the default model's tied Q8_0 table) the step multiplies it too and returns the
    logits (gives_logits): what compute_logits gives, without ~0.2 ms of host ops between two calls
    (on the Ice Lake Xeon, where the weights just streamed through the caches have pushed out the
    interpreter's)."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 rows: bool) -> None:
        weights, linears = [], []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for p in _projections(layer):
                w = p.qweight
                weights += [w.codes, w.scales, w.offsets]
                linears += [w.bits, w.group_size, w.shape[0], int(p.activation_bits == 16)]
            weights += [k_cache, v_cache]
        head, head_ints = [], []
        if model.lm_head is not None and (_runs_i8 if rows else _runs_vnni)(model.lm_head):
            w = model.lm_head.qweight
            head, head_ints = [w.codes, w.scales, w.offsets], [w.bits, w.group_size, w.shape[0],
                                                               int(model.lm_head.activation_bits == 16)]
        first = model.layers[0]
        fused_step = torch.classes.tokenmill.DecodeLayersRows if rows else torch.classes.tokenmill.DecodeLayers
        self.rows = rows
        self.gives_logits = bool(head)
        self.layers = fused_step(weights, linears, first.self_attn.num_heads, first.self_attn.num_kv_heads,
                                 first.self_attn.scale, first.input_layernorm.eps, model.norm.weight, head, head_ints)

    @staticmethod
    def applies(model: DecoderForCausalLM) -> bool:
        """Whether every layer can run in DecodeLayers (see the module docstring)."""
        if os.environ.get("TOKENMILL_DECODE_LAYERS", "1") == "0":
            return False
        return all(layer.self_attn.q_norm is None and all(map(_runs_vnni, _projections(layer))) for layer in model.layers)

    @staticmethod
    def applies_rows(model: DecoderForCausalLM) -> bool:
        """Whether every layer can run in DecodeLayersRows: a float32 model whose projections all
        run quant_gemv_i8 over the row layout, without biases or q/k norms."""
        if os.environ.get("TOKENMILL_DECODE_LAYERS", "1") == "0" or not decode_attention_rows_available():
            return False
        attention = model.layers[0].self_attn
        if attention.num_heads // attention.num_kv_heads > ROWS_MAX_QUERY_GROUPS:
            return False
        return model.norm.weight.dtype == torch.float32 and all(
            layer.self_attn.q_norm is None and layer.input_layernorm.weight.dtype == torch.float32
            and all(map(_runs_i8, _projections(layer))) for layer in model.layers)

    def __call__(self, x: torch.Tensor, rope, metadata) -> torch.Tensor:
        """x: the step's embeddings [T, hidden] (the residual stream, changed in place) -> the final
        norm's output, or where gives_logits the float32 logits [T, vocab]."""
        decode = metadata.decode
        if self.rows:
            return self.layers.forward(x, rope.positions, rope.cos_cache, rope.sin_cache, metadata.write_index,
                                       decode.block_table, decode.seq_lens)
        return self.layers.forward(x, rope.positions, rope.cos_cache, rope.sin_cache, metadata.slots,
                                   decode.block_table, decode.seq_lens, decode.context_len)


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _runs_i8(module: nn.Module) -> bool:
    """Whether the module is a bias-free projection whose few rows go through quant_gemv_i8 (AVX2)."""
    return (isinstance(module, QuantizedLinear) and isinstance(module.qweight, QuantizedWeight)
            and module.bias is None and module.few_row_kernel() is not None)


def _runs_vnni(module: nn.Module) -> bool:
    """Whether the module is a bias-free projection whose few rows go through quant_gemv_q8."""
    return (isinstance(module, QuantizedLinear) and isinstance(module.qweight, InterleavedWeight)
            and module.bias is None and module.few_row_kernel() is not None)


class DecodePlan:
    """model's forward for few-row decode steps on the CPU kernels (see the module docstring)."""

    def __init__(self, model: DecoderForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        first = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.scale
        self.eps = model.layers[0].input_layernorm.eps
        self.layers = []
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            gate_up, gate_up_is_kernel = _bound_linear(mlp.gate_up_proj)
            self.layers.append(LayerPlan(
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                qkv=_bound_linear(attn.qkv_proj)[0], o=_bound_linear(attn.o_proj)[0], gate_up=gate_up,
                down=_bound_linear(mlp.down_proj)[0], gate_up_is_kernel=gate_up_is_kernel,
                gate_up_module=mlp.gate_up_proj, q_norm=attn.q_norm, k_norm=attn.k_norm,
                k_cache=k_cache, v_cache=v_cache))
        self.fused = FusedLayers(model, kv_caches, rows=False) if FusedLayers.applies(model) else None
        # the AVX2 build's, over the PyTorch backend's caches
        self.fused_rows = FusedLayers(model, kv_caches, rows=True) if FusedLayers.applies_rows(model) else None

    @staticmethod
    def applies(backend: object) -> bool:
        """Whether a plan can run decode steps with this attention backend: the AVX-512 kernels' own,
        or on the AVX2 build the PyTorch one."""
        if isinstance(backend, CpuPagedAttention):
            return kernels_available()
        return isinstance(backend, TorchPagedAttention) and fused_ops_available() and decode_attention_rows_available()

    @staticmethod
    def covers(input_ids: torch.Tensor, ctx: AttentionContext) -> bool:
        """Whether this step is one the plan runs: decode only, at most GEMV_MAX_ROWS sequences."""
        metadata = ctx.metadata
        decode = metadata.decode
        whole = isinstance(decode, KernelDecodeBucket) or (isinstance(decode, DecodeBucket) and decode.covers_batch)
        return metadata.prefill is None and not metadata.fresh_prefills and whole and input_ids.shape[0] <= GEMV_MAX_ROWS

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> tuple[torch.Tensor, bool]:
        """input_ids, positions: [T] -> (hidden states [T, hidden] as model(input_ids, positions, ctx)
        gives them, False), or where the fused layers multiply the head too (float32 logits [T,
        vocab] as model.compute_logits of those hidden states gives them, True)."""
        ops = torch.ops.tokenmill
        rms_norm, add_rms_norm, fused_silu = ops.rms_norm.default, ops.add_rms_norm_.default, ops.silu_and_mul.default
        num_heads, num_kv_heads, head_dim, eps = self.num_heads, self.num_kv_heads, self.head_dim, self.eps
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        backend, metadata = ctx.backend, ctx.metadata
        x = self.model.embed_tokens(input_ids)
        num_tokens = x.shape[0]
        rope = self.model.rotary.step(positions, x.dtype)
        # rotary by our kernel, and the paged kernel's backend: it can run inside the attention op
        fused_attention = rope.tables is None and isinstance(backend, CpuPagedAttention)
        if fused_attention and self.fused is not None:
            return self.fused(x, rope, metadata), self.fused.gives_logits
        # the AVX2 build's: rotary, KV write and decode_attention_rows in one op
        fused_rows = (rope.tables is None and isinstance(backend, TorchPagedAttention) and decode_attention_rows_available()
                      and metadata.decode.gather_index is None)  # the op's bucket (up to 8 query heads per kv head)
        if fused_rows and self.fused_rows is not None:
            return self.fused_rows(x.contiguous(), rope, metadata), self.fused_rows.gives_logits
        residual = None
        for layer in self.layers:
            if residual is None:
                residual, h = x, rms_norm(x, layer.input_norm, eps)
            else:
                h = add_rms_norm(x, residual, layer.input_norm, eps)
            qkv = layer.qkv(h)
            if layer.q_norm is None and fused_attention:
                out = fused_decode_attention(qkv, num_heads, num_kv_heads, rope, layer.k_cache, layer.v_cache,
                                             metadata, self.scale)
            elif layer.q_norm is None and fused_rows:
                out = fused_decode_attention_rows(qkv, num_heads, num_kv_heads, rope, layer.k_cache, layer.v_cache,
                                                  metadata, self.scale)
            else:
                v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
                if layer.q_norm is None:
                    qk = rope.rotate(qkv[:, : q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim))
                    q, k = qk[:, :num_heads], qk[:, num_heads:]
                else:
                    q = layer.q_norm(qkv[:, :q_size].view(num_tokens, num_heads, head_dim))
                    k = layer.k_norm(qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim))
                    q, k = rope.rotate(q), rope.rotate(k)
                out = backend.forward(q, k, v, layer.k_cache, layer.v_cache, metadata, self.scale)
            h = add_rms_norm(layer.o(out), residual, layer.post_norm, eps)
            gated = fused_silu(layer.gate_up(h)) if layer.gate_up_is_kernel else silu_and_mul(layer.gate_up_module, h)
            x = layer.down(gated)
        return self.model.norm(x, residual), False
