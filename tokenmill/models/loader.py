"""Find a model (HF directory, .gguf file, or the default), build it and load its weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelLoadError
from tokenmill.layers.gpu_quantized import prepare_quantized_linears
from tokenmill.layers.linear import linear_weight_bytes, pack_linear_weights, packing_available
from tokenmill.layers.parallel import Communicator
from tokenmill.layers.quantized import (
    QuantizedWeight, batches_read_codes, describe_weight_formats, interleave_weights, interleaving_pays,
    quantize_linear_layers, round_rows_like_batches, rounds_rows_to_8_bits,
)
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.gguf_loader import GGUFFile
from tokenmill.models.hf_config import load_hf_config, load_hf_config_file
from tokenmill.models.llama import DecoderForCausalLM
from tokenmill.models.model_files import load_decoding_tokenizer, load_tokenizer, resolve_model_path
from tokenmill.models.safetensors_loader import iter_safetensors
from tokenmill.models.sharding import shard_config, shard_weights, vocab_parallel_head, wrap_parallel
from tokenmill.platform import available_memory_bytes, release_free_memory

logger = logging.getLogger(__name__)

TOKENIZER_LOADERS = {"full": load_tokenizer, "decoding": load_decoding_tokenizer, "none": lambda path: None}

QUANTIZATION_CHOICES = (None, "none", "int8", "int4")


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    path: Path
    config: ModelConfig
    model: DecoderForCausalLM
    tokenizer: object  # transformers' PreTrainedTokenizerFast, a DecodingTokenizer, or None (load_model)
    max_model_len: int
    weight_formats: str = ""  # how the weights are held, e.g. "int4 g32 x 211; bfloat16 rest"


def load_model_config(model: str | Path | None) -> ModelConfig:
    """The ModelConfig of an HF directory, a config.json, a .gguf file or the default model;
    no weights are read."""
    path = resolve_model_path(model)
    if path.is_dir():
        return load_hf_config(path)
    if path.suffix == ".gguf":
        return GGUFFile(path).model_config()
    if path.suffix == ".json":
        return load_hf_config(path.parent) if path.name == "config.json" else load_hf_config_file(path)
    raise ModelLoadError(f"{path.name}: expected an HF model directory, a config.json or a .gguf file")


def load_model(model: str | None, dtype: torch.dtype, device: torch.device, max_model_len: int | None = None,
               shard: Communicator | None = None, tokenizer: str = "full",
               quantization: str | None = None, dtype_was_auto: bool = False) -> LoadedModel:
    """Load config, weights and tokenizer. Every failure is a ModelLoadError.

    With `shard`, only this tensor-parallel rank's slices are kept (LoadedModel.config is still the
    whole model's); `tokenizer`: "full" (transformers': prompts, chat templates), "decoding" (an
    engine whose server tokenizes: model_files.load_decoding_tokenizer), "none" (workers never decode).
    `quantization`: None keeps a GGUF's own quantized weights (and an HF model's dtype), "none"
    dequantizes everything to `dtype`, "int8" / "int4" quantize the layers' linears at load.
    `dtype_was_auto`: the engine chose `dtype`, and may choose its speed path's rounding with it
    (quantized.rounds_rows_to_8_bits).
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"quantization must be one of {', '.join(map(str, QUANTIZATION_CHOICES))}, "
                             f"not {quantization!r}")
    path = resolve_model_path(model)
    # One after the other: the tokenizer on a thread of its own (importing transformers: Python,
    # holding the GIL) slowed the weights' many small torch ops down more than it overlapped them,
    # GGUF and safetensors alike (0.2-0.4 s later to ready), and its heap kept ~70 MB resident.
    net, config, context = _load_weights(path, dtype, device, max_model_len, shard, quantization, dtype_was_auto)
    loaded_tokenizer = TOKENIZER_LOADERS[tokenizer](path)
    release_free_memory()  # the temporaries of repacking: resident until trimmed
    eos = loaded_tokenizer.eos_token_id if loaded_tokenizer is not None else None
    if eos is not None and eos not in config.eos_token_ids:
        config.eos_token_ids.append(eos)
    return LoadedModel(path=path, config=config, model=net, tokenizer=loaded_tokenizer, max_model_len=context,
                       weight_formats=describe_weight_formats(net, dtype))


def _load_weights(path: Path, dtype: torch.dtype, device: torch.device, max_model_len: int | None,
                  shard: Communicator | None, quantization: str | None,
                  dtype_was_auto: bool) -> tuple[DecoderForCausalLM, ModelConfig, int]:
    config, weights = _open_weights(path, quantization)
    context = config.max_position_embeddings
    if config.sliding_window is not None and config.sliding_window < context:
        logger.warning("sliding-window attention is not implemented: capping context at %d", config.sliding_window)
        context = config.sliding_window
    if max_model_len is not None:
        if max_model_len > context:
            raise ModelLoadError(f"max_model_len {max_model_len} exceeds the model's context length {context}")
        context = max_model_len

    check_fits_in_memory(config, context, dtype, device, 1 if shard is None else shard.world_size,
                         weights_held_as(quantization, path.is_file(), dtype, device))
    if shard is None:
        net = build_model(config, context, dtype, device)
        net.load_weights(weights)
    else:
        net = build_model(shard_config(config, shard.world_size), context, dtype, device)
        tables: dict[str, QuantizedWeight] = {}
        net.load_weights(shard_weights(weights, config, shard, tables))
        wrap_parallel(net, config.vocab_size, shard, vocab_parallel_head(tables, config.tie_word_embeddings))
    net.eval()
    # Before repacking adds its own: the GGUF's mapping let go (its pages are resident once read,
    # ~the file's size; only the weights' iterator holds the file) and glibc's kept temporaries trimmed.
    del weights
    release_free_memory()
    if quantization in ("int8", "int4"):  # the decoder layers' linears; embedding and head keep their dtype
        quantize_linear_layers(net.layers, 8 if quantization == "int8" else 4)
    maybe_pack_weights(net, dtype, device)
    if interleaving_pays(device, dtype):  # after packing: that dequantizes from the row layout
        interleave_weights(net)
    if rounds_rows_to_8_bits(device, dtype, dtype_was_auto):
        round_rows_like_batches(net)
    if device.type == "cuda":  # our quantized kernels are CPU code: torch's int4 matmul, else dense copies
        counts = prepare_quantized_linears(net, dtype, device)
        if any(counts.values()):
            logger.info("quantized linears on %s: %s", device, counts)
    return net, config, context


def _open_weights(path: Path, quantization: str | None):
    """The model's config and an iterator over its weights (a GGUF's own quantized tensors kept
    unless `quantization` asks otherwise); the file is referenced by the iterator alone."""
    if not path.is_file():
        return load_hf_config(path), iter_safetensors(path)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path.name}: a model is an HF directory or a .gguf file")
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    return config, gguf_file.iter_tensors(config, keep_quantized=quantization is None)


def linears_stay_quantized(model: str | None, quantization: str | None) -> bool:
    """Whether the model's linear weights stay quantized in CPU memory: int8/int4 asked for, or a
    GGUF's own (what dtype "auto" weighs, platform.resolve_dtype)."""
    is_gguf = resolve_model_path(model).is_file()
    return weights_held_as(quantization, is_gguf, torch.bfloat16, torch.device("cpu")) is not None


def weights_held_as(quantization: str | None, is_gguf: bool, dtype: torch.dtype, device: torch.device) -> str | None:
    """How the linear weights are held once loaded, for check_fits_in_memory: "int8" or "int4"
    where they stay quantized (a GGUF's own mix counts as int4), None where they are dense in the
    model's dtype. On CUDA only 4-bit weights of bf16 models stay quantized (torch's int4 matmul);
    every other one becomes a dense copy there (layers/gpu_quantized.py)."""
    if quantization == "int8":
        held = "int8"
    elif quantization == "int4" or (quantization is None and is_gguf):
        held = "int4"
    else:
        return None
    if device.type == "cuda" and (held != "int4" or dtype != torch.bfloat16):
        return None
    return held


def check_fits_in_memory(config: ModelConfig, context: int, dtype: torch.dtype, device: torch.device,
                         world_size: int = 1, weight_quant: str | None = None) -> None:
    """Refuse, before allocating anything, a model whose weights (this rank's share), rotary tables
    and one KV block cannot fit the memory available now; the message gives both numbers."""
    from tokenmill.models.model_math import ModelMath

    weights = ModelMath(config).weight_bytes(str(dtype).removeprefix("torch."), weight_quant) / world_size
    rotary = 4 * context * config.head_dim * 4  # cos and sin tables in float32, and their temporaries
    kv_block = config.kv_bytes_per_block(16, dtype.itemsize) / world_size
    needed, available = weights + rotary + kv_block, available_memory_bytes(device)
    if needed > available:
        raise ModelLoadError(
            f"the model needs {needed / 1e9:.2f} GB (weights {weights / 1e9:.2f} GB, rotary tables for "
            f"{context} positions {rotary / 1e9:.2f} GB, one KV block) but only {available / 1e9:.2f} GB "
            f"of {device.type} memory are available; try --max-model-len or a quantized model")


def maybe_pack_weights(net: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """On bf16 CPUs, add oneDNN-packed copies of the linear weights (~20% faster batched matmuls)
    when the extra copy costs under a tenth of the free memory; quantized linears get none where
    their batches run csrc/quant_gemm.cpp."""
    if not packing_available(device, dtype):
        return
    quantized_too = not batches_read_codes(device, dtype)  # else their batches read the codes
    net.untie_lm_head()
    extra = linear_weight_bytes(net, quantized_too)
    if extra > 0.1 * available_memory_bytes(device):
        logger.info("not packing weights for oneDNN: %d MB extra would not fit comfortably", extra >> 20)
        return
    pack_linear_weights(net, quantized_too)


def _materialize(net: torch.nn.Module, device: torch.device) -> None:
    """Module.to_empty(device), without its empty_like: on meta tensors that goes through torch's
    reference decompositions, which import sympy (~1 s of every start-up)."""
    for module in net.modules():
        for name, param in module.named_parameters(recurse=False):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            module.register_buffer(name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device),
                                   persistent=name not in module._non_persistent_buffers_set)


def build_model(config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """An uninitialised model on `device` (weights come from load_weights)."""
    with torch.device("meta"):
        net = DecoderForCausalLM(config, max_positions)
    _materialize(net.to(dtype=dtype), device)
    for module in net.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_cache(device)
    return net
