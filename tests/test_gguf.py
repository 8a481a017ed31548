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


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> float32 of the little-endian fp16 they hold."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scale and min of each of the 8 sub-blocks packed into a K-quant's 12 bytes: [..., 8] each."""
    s = scales.astype(np.int32)
    low = s[..., 0:4] & 63, s[..., 4:8] & 63  # sub-blocks 0-3
    high_scale = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)  # sub-blocks 4-7
    high_min = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([low[0], high_scale], -1), np.concatenate([low[1], high_min], -1)


def reference_dequantize(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> np.ndarray:
    """Our own reading of llama.cpp's block layouts (ggml-common.h), independent of the gguf package."""
    rows = shape[0]
    if type_name == "F32":
        return data.astype(np.float32).reshape(shape)
    if type_name == "F16":
        return data.astype(np.float32).reshape(shape)
    if type_name == "BF16":
        return (data.reshape(rows, -1).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    b = data.reshape(rows, -1)
    if type_name == "Q8_0":  # 34-byte blocks of 32: fp16 d, int8 q[32]; w = d * q
        blocks = b.reshape(rows, -1, 34)
        out = _f16(blocks[..., 0:2])[..., None] * blocks[..., 2:].view(np.int8)
    elif type_name in ("Q4_0", "Q4_1"):  # fp16 d, (fp16 m), 16 bytes: element j low nibble, j + 16 high
        size, qs_at = (18, 2) if type_name == "Q4_0" else (20, 4)
        blocks = b.reshape(rows, -1, size)
        qs = blocks[..., qs_at:].astype(np.int32)
        q = np.concatenate([qs & 0xF, qs >> 4], -1)
        d = _f16(blocks[..., 0:2])[..., None]
        out = d * (q - 8) if type_name == "Q4_0" else d * q + _f16(blocks[..., 2:4])[..., None]
    elif type_name in ("Q4_K", "Q5_K"):
        # 256-element super-blocks: fp16 d, fp16 dmin, 12 bytes of scales, [Q5_K: 32 bytes of high bits],
        # 128 bytes of nibbles. Chunk c (64 elements) = bytes 32c..32c+31: sub-block 2c the low nibbles,
        # 2c + 1 the high ones; Q5_K adds 16 where bit 2c (or 2c + 1) of qh[l] is set. w = d*sc*q - dmin*m.
        size = 144 if type_name == "Q4_K" else 176
        blocks = b.reshape(rows, -1, size)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        sc, m = _k_scales(blocks[..., 4:16])
        qs = blocks[..., size - 128:].astype(np.int32).reshape(rows, -1, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], 3)  # [rows, blocks, chunk, low/high, 32]
        if type_name == "Q5_K":
            qh = blocks[..., 16:48].astype(np.int32)[:, :, None, None, :]
            bit = (2 * np.arange(4))[:, None, None] + np.arange(2)[None, :, None]  # [chunk, low/high, 1]
            q = q + ((qh >> bit) & 1) * 16
        q = q.reshape(rows, -1, 8, 32)
        out = d[..., None, None] * sc[..., None] * q - dmin[..., None, None] * m[..., None]
    elif type_name == "Q6_K":
        # 210 bytes per 256: ql[128] low nibbles, qh[64] 2-bit highs, int8 scales[16] (one per 16), fp16 d.
        # Half h (128 elements): ql[64h:64h+64], qh[32h:32h+32]; for l < 32 the four elements l, l+32,
        # l+64, l+96 take ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high and qh[l] bits 0-1, 2-3, 4-5, 6-7.
        blocks = b.reshape(rows, -1, 210)
        ql = blocks[..., 0:128].astype(np.int32).reshape(rows, -1, 2, 64)
        qh = blocks[..., 128:192].astype(np.int32).reshape(rows, -1, 2, 32)
        scales = blocks[..., 192:208].view(np.int8).astype(np.float32)  # [rows, blocks, 16]
        d = _f16(blocks[..., 208:210])
        low = [ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4]
        q = np.stack([low[i] | (((qh >> (2 * i)) & 3) << 4) for i in range(4)], 3) - 32  # [rows, blocks, 2, 4, 32]
        out = d[..., None] * scales.repeat(16, -1) * q.reshape(rows, -1, 256)
    else:
        raise ValueError(type_name)
    return out.reshape(shape).astype(np.float32)


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
    return data, reference_dequantize(data, type_name, shape)


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
        torch.testing.assert_close(got, torch.from_numpy(want), atol=1e-6, rtol=1e-6, msg=name)


def test_reference_reader_on_hand_built_blocks():
    """The reference decoder itself, on blocks whose values are worked out by hand."""
    f16 = lambda x: np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)  # noqa: E731
    q8 = np.concatenate([f16(0.5), np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    assert reference_dequantize(q8[None], "Q8_0", (1, 32)).tolist() == [[0.5 * q for q in range(-16, 16)]]
    nibbles = np.array([0x91] * 16, dtype=np.uint8)  # low nibble 1, high nibble 9
    q4 = np.concatenate([f16(2.0), nibbles])
    assert reference_dequantize(q4[None], "Q4_0", (1, 32)).tolist() == [[2.0 * (1 - 8)] * 16 + [2.0 * (9 - 8)] * 16]
    q41 = np.concatenate([f16(2.0), f16(-1.0), nibbles])
    assert reference_dequantize(q41[None], "Q4_1", (1, 32)).tolist() == [[2.0 * 1 - 1] * 16 + [2.0 * 9 - 1] * 16]
    # Q4_K: sub-block 0 scale 2 / min 3, sub-block 5 scale 17 (0x11: low 4 bits in byte 9, bits 4-5 in byte 1's
    # top two) / min 33 (0x21: low 4 bits in byte 9's high nibble, bits 4-5 in byte 5's top two); qs all 0x75
    scales = np.zeros(12, dtype=np.uint8)
    scales[0], scales[4] = 2, 3
    scales[9] = 0x1 | (0x1 << 4)
    scales[1] |= 1 << 6
    scales[5] |= 2 << 6
    q4k = np.concatenate([f16(1.0), f16(0.5), scales, np.full(128, 0x75, dtype=np.uint8)])
    values = reference_dequantize(q4k[None], "Q4_K", (1, 256))[0]
    assert values[0] == 1.0 * 2 * 5 - 0.5 * 3  # sub-block 0: low nibbles of chunk 0
    assert values[5 * 32] == 1.0 * 17 * 7 - 0.5 * 33  # sub-block 5: high nibbles of chunk 2
    assert values[32] == 0.0  # sub-block 1: scale 0, min 0


def test_permutation_round_trip():
    weight = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert np.array_equal(_unpermute(_permute(weight, 2), 2), weight)
    from tokenmill.models.gguf_loader import _unpermute as ours

    assert torch.equal(ours(torch.from_numpy(_permute(weight, 2)), 2), torch.from_numpy(weight))
