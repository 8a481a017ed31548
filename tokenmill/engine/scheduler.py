"""Continuous batching: every step, decide which tokens of which requests to compute.

Running requests go first (their next token, or their next prefill chunk); then waiting
requests are admitted while the token budget, max_num_seqs and free blocks allow. When
blocks run out, the most recently admitted running request is preempted: its blocks are
freed and it goes back to the head of the queue to be recomputed later.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler_output import (
    PromptLogprobsRequest, SamplingRequest, ScheduledSequence, SchedulerOutput, TokenBitmaskRow,
)
from tokenmill.engine.structured_output import token_bitmasks
from tokenmill.engine.engine_info import check_fits
from tokenmill.outputs import Logprob, ModelRunnerOutput, SampledToken

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting queue and the running batch."""

    def __init__(self, config: SchedulerConfig, max_model_len: int, kv_cache: KVCacheManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-masks")

    # ---- admission -------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLongError if such a request could never be served."""
        check_fits(num_prompt_tokens, max_tokens, self.max_model_len, self.kv_cache.pool.num_blocks,
                   self.kv_cache.block_size)

    def add_request(self, request: Request) -> None:
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                output.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                output.sequences.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted: nothing behind it can run either

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            leader = request.prefill_leader
            if leader is not None and not leader.is_finished and not leader.is_prefill_done:
                break  # wait one step or two so the siblings can share the prompt's blocks
            hits, num_hit_tokens = [], 0
            if request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
                hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit_tokens
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = time.time()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.sequences.append(self._scheduled(request, num_new))
            budget -= num_new
        self._add_token_bitmasks(output)
        return output

    def _add_token_bitmasks(self, output: SchedulerOutput) -> None:
        """Structured outputs: what each constrained sequence that samples may sample next, computed
        for all of them at once. The matchers are not touched again before update(), which comes
        after the sampler has waited for the masks."""
        constrained = [(seq.sampling, grammar) for seq in output.sequences
                       if seq.sampling is not None and (grammar := self.requests[seq.request_id].grammar) is not None]
        if constrained:
            # llguidance works without the GIL: the masks are ready by the time the logits are
            batch = self._mask_thread.submit(token_bitmasks, [grammar for _, grammar in constrained])
            for row, (sampling, _) in enumerate(constrained):
                sampling.allowed_tokens = TokenBitmaskRow(batch, row)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSequence:
        start = request.num_computed_tokens
        sampling = None
        if start + num_new == request.num_tokens and request.max_tokens > 0:  # reaches the end: sample next
            sampling = SamplingRequest(request.sampling_params, request.seed, request.prompt_token_ids,
                                       request.output_token_ids, request.stop_token_ids)
        return ScheduledSequence(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start : start + num_new],
            num_computed_tokens=start,
            block_ids=self.kv_cache.block_ids(request.request_id),
            sampling=sampling,
            prompt_logprobs=_prompt_logprobs_request(request, start, num_new),
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, output: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance each scheduled request; returns those that got a new token (finished ones included)."""
        now = time.time()
        sampled_iter = iter(result.sampled)
        updated = []
        for seq in output.sequences:
            request = self.requests[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            self.kv_cache.cache_computed_blocks(request)  # their KV is written now
            if seq.prompt_logprobs is not None:
                request.prompt_logprobs += [_logprob_entry(t) for t in result.prompt_logprobs[seq.request_id]]
            if seq.sampling is None:
                if request.max_tokens == 0 and request.is_prefill_done:  # the prompt only: done
                    request.status = RequestStatus.FINISHED_LENGTH
                    updated.append(request)
                continue
            token = next(sampled_iter)
            request.append_output_token(token.token_id)
            if request.logprobs is not None:
                request.logprobs.append(_logprob_entry(token))
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            self._check_stop(request, token.token_id)
            updated.append(request)
        for request in updated:
            if request.is_finished:
                self._remove(request)
        return updated

    def _check_stop(self, request: Request, token_id: int) -> None:
        params = request.sampling_params
        if request.grammar is not None and not request.grammar.accept(token_id):
            # the sampler masks what the grammar forbids, so this is a bug, not the user's doing
            logger.error("request %s: sampled token %d breaks its grammar", request.parent_id, token_id)
            request.status = RequestStatus.FINISHED_ERROR
            return
        if token_id in request.stop_token_ids and params.may_stop_at(request.num_output_tokens):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token_id if token_id in params.stop_token_ids else None  # None: EOS
            return
        if request.grammar is not None and request.grammar.is_terminated:  # nothing may follow but EOS
            request.status = RequestStatus.FINISHED_STOPPED
            return
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH

    # ---- leaving -----------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request now (abort, or a stop string found by the detokenizer); frees its blocks."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        request.status = status
        self._remove(request)

    def _remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.metrics.finished_time = time.time()
        del self.requests[request.request_id]


def _prompt_logprobs_request(request: Request, start: int, num_new: int) -> PromptLogprobsRequest | None:
    """The prompt tokens this step's new tokens score that are not scored yet (a recompute after
    preemption scores nothing twice): the logits at position p score prompt token p + 1."""
    if not request.needs_prompt_logprobs:
        return None
    first = max(start, len(request.prompt_logprobs) - 1)
    end = min(start + num_new, request.num_prompt_tokens - 1)
    if end <= first:
        return None
    return PromptLogprobsRequest(first - start, request.prompt_token_ids[first + 1: end + 1],
                                 request.sampling_params.prompt_logprobs)


def _logprob_entry(token: SampledToken) -> dict[int, Logprob]:
    entry = {token.token_id: Logprob(token.logprob, token.rank)}
    for rank, (token_id, logprob) in enumerate(token.top_logprobs or [], start=1):
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, rank)
    return entry
