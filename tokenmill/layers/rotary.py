"""Rotary position embeddings (rotate-half layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.errors import ModelLoadError
from tokenmill.layers.cpu_kernels import fused_ops_available

# off the CPU, steps of at most this many tokens rotate by matrices (one bmm a layer; decode)
MATRIX_ROTATION_MAX_TOKENS = 256


def _base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for the given rope_scaling dict (HF's keys); a malformed
    one is a ModelLoadError."""
    try:
        inv_freq = _scaled_inv_freq(head_dim, theta, scaling)
    except (KeyError, TypeError, ValueError, RuntimeError, ZeroDivisionError) as exc:
        raise ModelLoadError(f"malformed rope_scaling {repr(scaling)[:120]}: {type(exc).__name__} {exc}") from None
    if inv_freq.shape != (head_dim // 2,) or not torch.isfinite(inv_freq).all():
        raise ModelLoadError(f"rope_scaling {repr(scaling)[:120]} does not give {head_dim // 2} finite frequencies")
    return inv_freq


def _scaled_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = _base_inv_freq(head_dim, theta)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "freq_factors":  # llama.cpp stores llama3 scaling as per-frequency divisors
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ModelLoadError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k at arbitrary (ragged) positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)

    def build_cache(self, device: torch.device) -> None:
        """Compute the float32 cos/sin tables (the model is built on `meta`, so this runs after)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos_cache = emb.cos().to(device)
        self.sin_cache = emb.sin().to(device)

    def step(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        """What every layer of one step rotates by."""
        if positions.device.type == "cpu" and _fused_available():
            return RopeStep(positions, self.cos_cache, self.sin_cache, None)
        tables = self.cos_sin(positions, dtype)
        if positions.device.type != "cpu" and positions.shape[0] <= MATRIX_ROTATION_MAX_TOKENS:
            return RopeStep(positions, self.cos_cache, self.sin_cache, tables, rotation_matrices(*tables))
        return RopeStep(positions, self.cos_cache, self.sin_cache, tables)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for one step, shared by every layer: ([T, 1, head_dim], [T, 1, head_dim]).

        The sine comes with the sign of rotate-half folded in, so that applying the rotation is
        x * cos + roll(x, head_dim / 2) * sin.
        """
        half = self.head_dim // 2
        cos = self.cos_cache[positions].unsqueeze(1).to(dtype)
        sin = self.sin_cache[positions].unsqueeze(1)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)
        return cos, sin


@dataclass
class RopeStep:
    """One step's rotation: in place by our CPU kernel (csrc/fused_ops.cpp) from the float32
    tables, or with PyTorch ops from per-step tables in the model's dtype."""

    positions: torch.Tensor  # [T] int64
    cos_cache: torch.Tensor  # [max_positions, head_dim] float32
    sin_cache: torch.Tensor
    tables: tuple[torch.Tensor, torch.Tensor] | None  # RotaryEmbedding.cos_sin, for the PyTorch path
    matrices: torch.Tensor | None = None  # rotation_matrices of the tables, for short steps off the CPU

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim] -> rotated (x itself, rotated in place, on the kernel path)."""
        if self.matrices is not None:
            return torch.bmm(x, self.matrices)
        if self.tables is None:
            torch.ops.tokenmill.rotary_.default(x, self.positions, self.cos_cache, self.sin_cache)
            return x
        return apply_rotary(x, *self.tables)


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, head_dim, head_dim] matrices R with x @ R = apply_rotary(x, cos, sin) for each token's
    [heads, head_dim] rows: cos on the diagonal, sin a half turn below it. On a GPU a decode step's
    kernels are launch-bound, and one batched matmul a layer replaces three elementwise kernels (its
    two products and their sum are rounded once)."""
    cos, sin = cos[:, 0], sin[:, 0]  # [T, head_dim]
    return torch.diag_embed(cos) + torch.diag_embed(sin).roll(cos.shape[-1] // 2, dims=-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim] rotated by the tables from RotaryEmbedding.cos_sin."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), sin)


_fused_available = fused_ops_available  # a name of this module's own, for tests to switch off
