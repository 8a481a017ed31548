"""What an engine tells the world about itself: its figures (EngineStats), its fixed facts
(EngineFacts), the limits a request must fit (RequestLimits), and, for a server whose engine runs
in another process, all of that at once (EngineInfo). Plain data: no torch here."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ModelConfig
from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.kv_cache_manager import KVCacheStats
from tokenmill.engine.metrics import StepStats
from tokenmill.errors import InvalidParameterError, RequestTooLongError
from tokenmill.sampling_params import SamplingParams


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats
    num_steps: int = 0
    last_step: StepStats | None = None


def combine_stats(stats: list[EngineStats], up: list[bool]) -> EngineStats:
    """Several engines' figures as one: what is in use now summed over the engines that are up,
    what has been counted (steps, preemptions, prefix lookups) over all of them, so that a
    replica's death never makes a counter go back."""
    live = [s for s, is_up in zip(stats, up) if is_up]
    kv = [s.kv_cache for s in live]
    num_blocks = sum(k.num_blocks for k in kv)
    used = sum(k.num_used_blocks for k in kv)
    allocated = sum(k.num_slots_allocated for k in kv)
    stored = sum(k.num_tokens_stored for k in kv)
    combined_kv = KVCacheStats(
        num_blocks=num_blocks, num_used_blocks=used, num_free_blocks=sum(k.num_free_blocks for k in kv),
        usage=used / num_blocks if num_blocks else 0.0, num_slots_allocated=allocated, num_tokens_stored=stored,
        waste=1 - stored / allocated if allocated else 0.0,
        prefix_cache_queries=sum(s.kv_cache.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.kv_cache.prefix_cache_hits for s in stats))
    steps = [s.last_step for s in stats if s.last_step is not None]
    return EngineStats(
        num_running=sum(s.num_running for s in live), num_waiting=sum(s.num_waiting for s in live),
        num_preemptions=sum(s.num_preemptions for s in stats), kv_cache=combined_kv,
        num_steps=sum(s.num_steps for s in stats),
        last_step=max(steps, key=lambda step: step.start_time + step.duration) if steps else None)


@dataclass(frozen=True)
class EngineFacts:
    """What a dashboard shows about the loaded model and the engine around it."""

    model_file: str
    architecture: str
    dtype: str
    weights: str  # how the weights are held: quantized formats and the dense dtype
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    tensor_parallel_size: int


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the context, the KV pool, the vocabulary."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.num_kv_blocks, self.block_size)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt and its parameters; returns the effective max_tokens. Whatever passes
        cannot make a batched step fail."""
        if not prompt_token_ids:
            raise InvalidParameterError("the prompt is empty", param="prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_token_ids))
        self.check_fits(len(prompt_token_ids), max_tokens)
        vocab = self.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameterError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        if params.min_tokens > max_tokens:
            raise InvalidParameterError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens this prompt can generate",
                param="min_tokens")
        return max_tokens


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int, num_kv_blocks: int,
               block_size: int) -> None:
    """Raise RequestTooLongError if such a request could never be served."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestTooLongError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds max_model_len ({max_model_len})",
            param="max_tokens",
        )
    needed = -(-total // block_size)
    if needed > num_kv_blocks:
        raise RequestTooLongError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks "
            f"but the cache holds only {num_kv_blocks}",
            param="max_tokens",
        )


@dataclass
class EngineInfo:
    """What an engine process sends its server once the model is loaded."""

    model_path: str
    model_config: ModelConfig  # eos_token_ids include the tokenizer's
    dtype: str  # "bfloat16", ...
    device: str  # "cpu", "cuda:0", ...
    limits: RequestLimits
    facts: EngineFacts
    stats: EngineStats
    peaks: DevicePeaks  # known without measuring; an engine process may send better ones later
    kv_cache_dtype: str = ""  # what the KV pool holds ("float16", ...); "" from an older engine: dtype
