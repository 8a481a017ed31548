"""Configuration dataclasses: the model's shape and the engine's knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenmill.errors import ModelLoadError

DEFAULT_BLOCK_SIZE = 16
# The KV pool's default share of memory: of the RAM available at start on CPU (other programs
# share the machine), of the memory left free after the weights on CUDA.
DEFAULT_KV_CACHE_FRACTION = {"cpu": 0.05, "cuda": 0.8}
OTHER_DEVICE_KV_CACHE_FRACTION = 0.1
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # the server's limit on a request body


# Upper bounds far above any real model's, low enough that nothing absurd is ever allocated.
_INT_BOUNDS = {
    "vocab_size": 1 << 24, "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 1024, "max_position_embeddings": 1 << 24,
}


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, normalised from an HF config.json or GGUF metadata."""

    architecture: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Every field within sane bounds and of its type, before anything is allocated from it."""

        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                shown = repr(getattr(self, name))
                raise ModelLoadError(f"model config: {name} {why}, got {shown[:80]}")

        for name, upper in _INT_BOUNDS.items():
            value = getattr(self, name)
            check(name, type(value) is int and 1 <= value <= upper, f"must be an integer in [1, {upper}]")
        check("num_key_value_heads", self.num_attention_heads % self.num_key_value_heads == 0,
              f"must divide num_attention_heads ({self.num_attention_heads})")
        check("head_dim", self.head_dim % 2 == 0, "must be even (rotary embeddings rotate pairs)")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            check(name, isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                  and value > 0, "must be a positive number")
        check("rope_scaling", self.rope_scaling is None or isinstance(self.rope_scaling, dict), "must be an object")
        check("sliding_window", self.sliding_window is None or (type(self.sliding_window) is int
                                                                 and self.sliding_window > 0), "must be positive")
        check("eos_token_ids", all(type(t) is int and 0 <= t < self.vocab_size for t in self.eos_token_ids),
              f"must be token ids below vocab_size ({self.vocab_size})")

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases; other families when attention_bias is set."""
        return self.attention_bias or self.architecture == "qwen2"

    @property
    def has_o_bias(self) -> bool:
        """attention_bias puts a bias on o_proj too, except in Qwen2 (q/k/v only)."""
        return self.attention_bias and self.architecture != "qwen2"

    def kv_bytes_per_token(self, element_size: float) -> float:
        """KV cache bytes of one token across all layers, keys and values."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_size

    def kv_bytes_per_block(self, block_size: int, element_size: int) -> int:
        """Bytes one KV block of block_size tokens takes across all layers, keys and values."""
        return int(self.kv_bytes_per_token(element_size)) * block_size


@dataclass
class CacheConfig:
    """Paged KV cache: block size, memory budget and prefix caching."""

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None  # bytes; None = a share of free memory
    kv_cache_memory_fraction: float | None = None  # None: DEFAULT_KV_CACHE_FRACTION of the device type
    enable_prefix_caching: bool = True
    # Share of the pool that cached prefixes may fill (memory made resident) before freed blocks
    # are reused: beyond it, resident KV grows only with what is in use at once.
    prefix_cache_reserve: float = 0.25
    num_blocks: int | None = None  # overrides the memory budget (tests)
    # what the pool holds: "auto" (the model's dtype), or float16 / bfloat16 under a float32 model
    kv_cache_dtype: str = "auto"
    # Keys the prefix-block hashes; None: random per engine. Replicas behind one router share one.
    prefix_hash_key: bytes | None = None

    def memory_fraction(self, device_type: str) -> float:
        """The share of available memory the KV pool takes when no byte budget is given."""
        if self.kv_cache_memory_fraction is not None:
            return self.kv_cache_memory_fraction
        return DEFAULT_KV_CACHE_FRACTION.get(device_type, OTHER_DEVICE_KV_CACHE_FRACTION)


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's context length


@dataclass
class EngineConfig:
    """Everything LLM(...) takes, in one place."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    # None: a GGUF keeps its quantized weights; "none": dequantize; "int8"/"int4": quantize at load
    quantization: str | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying graphs
    rendezvous: object | None = None  # executor.tensor_parallel.Rendezvous under torchrun; None: spawn local workers
    # An engine whose server tokenizes (engine_process.serving_engine): it only decodes, with a
    # tokenizer that loads without transformers (models/decoding_tokenizer.py)
    decodes_only: bool = False
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def tokenizer_kind(self) -> str:
        """Which tokenizer the loader loads for this engine (loader.load_model's `tokenizer`)."""
        return "decoding" if self.decodes_only else "full"
