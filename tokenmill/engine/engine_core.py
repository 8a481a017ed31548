"""LLMEngine: the step loop (schedule -> execute -> update -> outputs) and request intake.

A step that raises is retried one sequence at a time, so that only the request that makes it
fail fails; everything else in the step goes on, and the waiting queue is never touched.
"""

from __future__ import annotations

import logging
import random
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.engine_info import EngineFacts, EngineStats, RequestLimits
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.metrics import StepStats
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.engine.structured_output import GrammarCompiler
from tokenmill.errors import EngineDeadError, InvalidParameterError
from tokenmill.executor.base import Executor, create_executor
from tokenmill.models.loader import linears_stay_quantized
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.platform import (
    available_memory_bytes, limit_onednn_primitive_cache, resolve_device, resolve_dtype, set_cpu_threads,
)
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns model, KV cache and scheduler; add requests, then call step() until done."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device,
                                   quantized_weights=linears_stay_quantized(config.model, config.quantization))
        if config.tensor_parallel_size < 1:
            raise InvalidParameterError("tensor_parallel_size must be at least 1", param="tensor_parallel_size")
        if self.device.type == "cpu":
            set_cpu_threads(config.tensor_parallel_size)  # the ranks share the cores
            limit_onednn_primitive_cache()
        self.executor: Executor = create_executor(config, self.device, self.dtype)
        self.kv_cache_dtype = self.executor.kv_cache_dtype
        loaded = self.executor.load_model()
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.input_processor = InputProcessor(loaded.tokenizer)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.config.eos_token_ids)
        self.max_model_len = loaded.max_model_len
        self.model_path = loaded.path
        self.weight_formats = loaded.weight_formats
        cache = config.cache
        # Each tensor-parallel rank holds its share of every block: size the pool by this rank's heads.
        bytes_per_block = loaded.model.config.kv_bytes_per_block(cache.block_size, self.kv_cache_dtype.itemsize)
        num_blocks = cache.num_blocks or self._num_blocks_from_budget(bytes_per_block)
        self.kv_cache = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                       hash_key=cache.prefix_hash_key, prefix_cache_reserve=cache.prefix_cache_reserve)
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, self.kv_cache)
        self.limits = RequestLimits(self.max_model_len, self.model_config.vocab_size, num_blocks, cache.block_size)
        self.executor.init_kv_cache(num_blocks)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        self._seed_rng = random.Random(config.seed)
        self.num_steps = 0
        self.last_step: StepStats | None = None
        logger.info(
            "loaded %s (%s, %s on %s): %d KV blocks of %d tokens (%s)",
            self.model_path.name, self.model_config.architecture, self.dtype, self.device, num_blocks, cache.block_size,
            self.kv_cache_dtype,
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
        """Check a prompt and its parameters against the model and the limits; returns the effective
        max_tokens. Whatever passes cannot make a batched step fail."""
        return self.limits.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
        prompt_text: str | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        """Queue a request (n samples). Raises a TokenmillError if it can never be served.

        prompt_text: the text of a prompt given as token ids, echoed back in the outputs.
        """
        if request_id in self.outputs.groups:
            raise InvalidParameterError(f"request id {request_id!r} is already in use", param="request_id")
        prompt_text = prompt if isinstance(prompt, str) else prompt_text
        prompt_token_ids = self.tokenize(prompt, add_special_tokens)
        max_tokens = self.validate_request(prompt_token_ids, params)
        eos = frozenset(self.model_config.eos_token_ids)
        grammar = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
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
                    arrival_time=arrival, grammar=None if grammar is None else grammar.new_matcher(),
                )
            )
        for child in children:
            self.scheduler.add_request(child)
        self.outputs.add(request_id, prompt_text, children, output_kind)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        return self._end_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _end_request(self, request_id: str, status: RequestStatus, error: BaseException | None = None):
        group = self.outputs.groups.get(request_id)
        if group is None:
            return None
        for child in group.children:
            self.scheduler.finish_request(child.request_id, status)
        return self.outputs.finish(request_id, error)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_request_ids(self) -> list[str]:
        return list(self.outputs.groups)

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that made progress (a request
        the engine failed on comes back finished with its `error`). Raises EngineDeadError only."""
        start = time.time()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        try:
            result = self.executor.execute(scheduler_output)
        except EngineDeadError:
            raise
        except Exception as exc:  # find the request that causes it; everything else goes on
            logger.error("engine step failed (%s); retrying its %d sequences one at a time",
                         type(exc).__name__, len(scheduler_output.sequences), exc_info=exc)
            outputs, num_sampled = self._step_one_at_a_time(scheduler_output)
        else:
            updated = self.scheduler.update(scheduler_output, result)
            outputs, num_sampled = self.outputs.process(updated), len(updated)
        self.num_steps += 1
        self.last_step = StepStats.from_schedule(scheduler_output, num_sampled, start, time.time() - start)
        return outputs

    def _step_one_at_a_time(self, scheduler_output: SchedulerOutput) -> tuple[list[RequestOutput], int]:
        outputs: list[RequestOutput] = []
        num_sampled = 0
        for seq in scheduler_output.sequences:
            if seq.request_id not in self.scheduler.requests:  # a sibling failed before it
                continue
            alone = SchedulerOutput([seq])
            try:
                result = self.executor.execute(alone)
            except EngineDeadError:
                raise
            except Exception as exc:
                request = self.scheduler.requests[seq.request_id]
                logger.error("request %s fails the engine step: %s", request.parent_id, type(exc).__name__)
                failed = self._end_request(request.parent_id, RequestStatus.FINISHED_ERROR, exc)
                if failed is not None:
                    outputs.append(failed)
                continue
            updated = self.scheduler.update(alone, result)
            num_sampled += len(updated)
            outputs += self.outputs.process(updated)
        return outputs, num_sampled

    def check_health(self) -> None:
        """Raise EngineDeadError if part of the engine (a tensor-parallel worker) is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, if any (the engine is unusable afterwards)."""
        self.executor.shutdown()

    def facts(self) -> EngineFacts:
        sched = self.config.scheduler
        return EngineFacts(
            model_file=self.model_path.name, architecture=self.model_config.architecture,
            dtype=str(self.dtype).removeprefix("torch."), weights=self.weight_formats,
            max_model_len=self.max_model_len, num_kv_blocks=self.kv_cache.pool.num_blocks,
            block_size=self.kv_cache.block_size, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens, device=str(self.device),
            tensor_parallel_size=self.config.tensor_parallel_size)

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
