"""GGUF loading: every supported tensor type, config from metadata, llama.cpp's Q/K permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.models.gguf_loader import GGUFFile

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 300, 2
HEAD_DIM = HIDDEN // HEADS

# tensor name -> type; every type the loader promises appears at least once
LAYER_TYPES = [
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "BF16",
     "ffn_gate": "Q8_0", "ffn_up": "F32", "ffn_down": "Q8_0"},
    {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
     "ffn_gate": "Q5_K", "ffn_up": "Q6_K", "ffn_down": "Q4_0"},
]


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows of llama-family models."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _quantized(rng: np.random.Generator, shape: tuple[int, int], type_name: str) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or array to store, the float32 values a correct reader must return)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    qtype = T[type_name]
    values = rng.standard_normal(shape).astype(np.float32) * 0.1
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):  # gguf cannot quantize K-quants: random blocks with sane scales
        block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
        scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
        if type_name == "Q6_K":
            raw[..., -2:] = scale  # d is the block's last field
        else:
            raw[..., 0:2] = scale  # d
            raw[..., 2:4] = scale  # dmin
        data = raw.reshape(shape[0], -1)
    else:
        data = gguf.quants.quantize(values, qtype)
    expected = gguf.quants.dequantize(data, qtype).reshape(shape).astype(np.float32)
    return data, expected


def write_tiny_gguf(path, arch: str) -> dict[str, np.ndarray]:
    """A random tiny model as GGUF; returns the HF-layout float32 weights a reader should produce."""
    import gguf

    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    expected: dict[str, np.ndarray] = {}

    def add(name: str, hf_name: str, shape: tuple[int, ...], type_name: str, permute_heads: int | None = None):
        if len(shape) == 1:
            data = rng.standard_normal(shape).astype(np.float32)
            writer.add_tensor(name, data)
            expected[hf_name] = data
            return
        data, values = _quantized(rng, shape, type_name)
        if permute_heads is not None:  # the file holds llama.cpp's permuted rows; the reader must undo it
            values = _unpermute(values, permute_heads)
        raw_dtype = None if data.dtype in (np.float32, np.float16) else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        expected[hf_name] = values

    add("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN), "Q8_0")
    add("output_norm.weight", "model.norm.weight", (HIDDEN,), "F32")
    for layer, types in enumerate(LAYER_TYPES):
        prefix, hf = f"blk.{layer}", f"model.layers.{layer}"
        add(f"{prefix}.attn_norm.weight", f"{hf}.input_layernorm.weight", (HIDDEN,), "F32")
        add(f"{prefix}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (HIDDEN,), "F32")
        permute = arch == "llama"
        add(f"{prefix}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (HIDDEN, HIDDEN), types["attn_q"],
            HEADS if permute else None)
        add(f"{prefix}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), types["attn_k"],
            KV_HEADS if permute else None)
        add(f"{prefix}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), types["attn_v"])
        add(f"{prefix}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (HIDDEN, HIDDEN), types["attn_output"])
        add(f"{prefix}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (FFN, HIDDEN), types["ffn_gate"])
        add(f"{prefix}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (FFN, HIDDEN), types["ffn_up"])
        add(f"{prefix}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (HIDDEN, FFN), types["ffn_down"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_tensor_type_reads_back(arch, tmp_path):
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(path, arch)
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    assert (config.architecture, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        arch, HIDDEN, HEADS, KV_HEADS)
    assert (config.vocab_size, config.num_hidden_layers, config.intermediate_size) == (VOCAB, LAYERS, FFN)
    assert config.tie_word_embeddings  # no output.weight
    loaded = dict(gguf_file.iter_tensors(config))
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        assert torch.equal(got, torch.from_numpy(want)), name


def test_permutation_round_trip():
    weight = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert np.array_equal(_unpermute(_permute(weight, 2), 2), weight)
    from tokenmill.models.gguf_loader import _unpermute as ours

    assert torch.equal(ours(torch.from_numpy(_permute(weight, 2)), 2), torch.from_numpy(weight))
