"""LLMEngine: the step loop (schedule -> execute -> update -> detokenize) and request intake."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.kv_cache_manager import KVCacheManager, KVCacheStats
from tokenmill.engine.metrics import StepStats
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.errors import InvalidParameterError
from tokenmill.executor.base import Executor, create_executor
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.platform import available_memory_bytes, resolve_device, resolve_dtype, set_cpu_threads
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    """The n samples of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: KVCacheStats
    num_steps: int = 0
    last_step: StepStats | None = None


class LLMEngine:
    """Owns model, KV cache and scheduler; add requests, then call step() until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.tensor_parallel_size < 1:
            raise InvalidParameterError("tensor_parallel_size must be at least 1", param="tensor_parallel_size")
        if self.device.type == "cpu":
            set_cpu_threads(config.tensor_parallel_size)  # the ranks share the cores
        self.executor: Executor = create_executor(config, self.device, self.dtype)
        loaded = self.executor.load_model()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.input_processor = InputProcessor(loaded.tokenizer)
        self.max_model_len = loaded.max_model_len
        self.model_path = loaded.path
        cache = config.cache
        # Each tensor-parallel rank holds its share of every block: size the pool by this rank's heads.
        bytes_per_block = loaded.model.config.kv_bytes_per_block(cache.block_size, self.dtype.itemsize)
        num_blocks = cache.num_blocks or self._num_blocks_from_budget(bytes_per_block)
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, self.kv_cache)
        self.executor.init_kv_cache(num_blocks)
        self._seed_rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_step: StepStats | None = None
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, tuple[_Group, int]] = {}
        logger.info(
            "loaded %s (%s, %s on %s): %d KV blocks of %d tokens",
            self.model_path.name, self.model_config.architecture, self.dtype, self.device, num_blocks, cache.block_size,
        )

    def _num_blocks_from_budget(self, bytes_per_block: int) -> int:
        """Blocks that fit the KV budget of one device."""
        cache = self.config.cache
        budget = cache.kv_cache_memory
        if budget is None:
            budget = int(available_memory_bytes(self.device) * cache.memory_fraction(self.device.type))
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise InvalidParameterError(
                f"kv_cache_memory ({budget} bytes) is smaller than one KV block ({bytes_per_block} bytes)",
                param="kv_cache_memory",
            )
        # More blocks than every sequence could ever use is memory for nothing.
        blocks_per_seq = -(-self.max_model_len // cache.block_size)
        return int(min(num_blocks, self.config.scheduler.max_num_seqs * blocks_per_seq))

    # ---- intake --------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a prompt against the limits; returns the effective max_tokens."""
        if not prompt_token_ids:
            raise InvalidParameterError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidParameterError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.max_model_len - len(prompt_token_ids))
        self.scheduler.check_fits(len(prompt_token_ids), max_tokens)
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        prompt_text: str | None = None,
    ) -> None:
        """Queue a request (n samples). Raises a TokenmillError if it can never be served.

        prompt_text: the text of a prompt given as token ids, echoed back in the outputs.
        """
        if request_id in self._groups:
            raise InvalidParameterError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text = prompt if isinstance(prompt, str) else prompt_text
        prompt_token_ids = self.tokenize(prompt, add_special_tokens)
        max_tokens = self.validate_request(prompt_token_ids, params)
        eos = frozenset(self.model_config.eos_token_ids)
        arrival = arrival_time or time.time()
        # Siblings of an n > 1 request wait for the first one's prompt, then share its blocks.
        share_prompt = self.kv_cache.enable_prefix_caching
        children: list[Request] = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            seed = self._seed_rng.getrandbits(63) if params.seed is None else _sample_seed(params.seed, index)
            children.append(
                Request(
                    request_id=child_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
                    max_tokens=max_tokens, seed=seed, eos_token_ids=eos, parent_id=request_id, index=index,
                    prompt=prompt_text, prefill_leader=children[0] if children and share_prompt else None,
                    arrival_time=arrival,
                )
            )
        group = _Group(
            request_id, prompt_text, prompt_token_ids, children,
            [IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params) for _ in children],
        )
        for child in children:
            self.scheduler.add_request(child)
        self._groups[request_id] = group
        for index, child in enumerate(children):
            self._child_to_group[child.request_id] = (group, index)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        for child in group.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
        return self._finish_group_if_done(group, {})

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return list(self._groups)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that made progress."""
        start = time.time()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        sampled = self.executor.execute(scheduler_output)
        updated = self.scheduler.update(scheduler_output, sampled)
        outputs = self._process_outputs(updated)
        self.num_steps += 1
        self.last_step = StepStats.from_schedule(scheduler_output, len(updated), start, time.time() - start)
        return outputs

    def _process_outputs(self, updated: list[Request]) -> list[RequestOutput]:
        deltas_by_group: dict[str, dict[int, str]] = {}
        for request in updated:
            group, index = self._child_to_group[request.request_id]
            detokenizer = group.detokenizers[index]
            token_id = request.output_token_ids[-1]
            if request.status == RequestStatus.FINISHED_STOPPED:
                delta = detokenizer.finish()  # the stop or EOS token adds no text
            else:
                delta = detokenizer.add_token(token_id, flush=request.is_finished)
                if detokenizer.stop_string is not None:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                    # also when the length limit already ended it on the token that completed the stop string
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, detokenizer.stop_string
            if request.logprobs is not None:
                self._decode_logprobs(request)
            deltas_by_group.setdefault(group.request_id, {})[index] = delta
        outputs = []
        for group_id, deltas in deltas_by_group.items():
            group = self._groups[group_id]
            finished = self._finish_group_if_done(group, deltas)
            outputs.append(finished or self._make_output(group, deltas))
        return outputs

    def _decode_logprobs(self, request: Request) -> None:
        for token_id, logprob in request.logprobs[-1].items():
            if logprob.decoded_token is None:
                logprob.decoded_token = self.tokenizer.decode([token_id])

    def _finish_group_if_done(self, group: _Group, deltas: dict[int, str]) -> RequestOutput | None:
        if not all(c.is_finished for c in group.children):
            return None
        for index, child in enumerate(group.children):
            rest = group.detokenizers[index].finish()
            if rest:
                deltas[index] = deltas.get(index, "") + rest
        del self._groups[group.request_id]
        for child in group.children:
            del self._child_to_group[child.request_id]
        return self._make_output(group, deltas)

    def _make_output(self, group: _Group, deltas: dict[int, str]) -> RequestOutput:
        outputs = []
        for child, detok in zip(group.children, group.detokenizers):
            outputs.append(
                CompletionOutput(
                    index=child.index,
                    text=detok.text[: detok.num_emitted],
                    token_ids=list(child.output_token_ids),
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=child.logprobs,
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=all(c.is_finished for c in group.children),
            metrics=_group_metrics(group.children),
            num_cached_tokens=group.children[0].num_cached_tokens,
            deltas=deltas,
        )

    def check_health(self) -> None:
        """Raise EngineDeadError if part of the engine (a tensor-parallel worker) is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (the engine is unusable afterwards)."""
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            kv_cache=self.kv_cache.stats(),
            num_steps=self.num_steps,
            last_step=self.last_step,
        )


def _sample_seed(seed: int, index: int) -> int:
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


def _group_metrics(children: list[Request]) -> RequestMetrics:
    first = children[0].metrics

    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    finished = [c.metrics.finished_time for c in children]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        first_scheduled_time=earliest(c.metrics.first_scheduled_time for c in children),
        first_token_time=earliest(c.metrics.first_token_time for c in children),
        finished_time=None if None in finished else max(finished),
        num_preemptions=sum(c.metrics.num_preemptions for c in children),
    )
