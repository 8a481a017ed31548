"""Scheduler + KV cache manager property tests, with a fake model runner."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import SchedulerConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.errors import RequestTooLongError
from tokenmill.outputs import ModelRunnerOutput, SampledToken
from tokenmill.sampling_params import SamplingParams

EOS = 0


def make_request(rid: str, prompt: list[int], max_tokens: int, leader: Request | None = None) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens, seed=0, eos_token_ids=frozenset({EOS}), prefill_leader=leader,
    )


class FakeModel:
    """Stands in for the runner and checks the schedule against its own record, never the scheduler's.

    It keeps every token it was given or sampled per request, and a fake KV cache: slot -> the
    token computed there. Each scheduled sequence must continue exactly where its cached context
    ends, with the right tokens, and that context must really hold the request's tokens (prefix
    hits and recomputation after preemption included).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}  # prompt + sampled, as this model saw them
        self.kv: dict[tuple[int, int], int] = {}
        self.step_no = 0

    def add(self, request: Request) -> None:
        self.tokens[request.request_id] = list(request.prompt_token_ids)

    def slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        return block_ids[position // self.block_size], position % self.block_size

    def run(self, output) -> list[SampledToken]:
        self.step_no += 1
        # As in the real forward, every layer writes all new K/V of the step before any attention reads.
        for seq in output.sequences:
            tokens, start = self.tokens[seq.request_id], seq.num_computed_tokens
            assert len(seq.block_ids) * self.block_size >= start + len(seq.token_ids)  # every new token has a slot
            assert seq.token_ids == tokens[start : start + len(seq.token_ids)]
            assert (seq.sampling is not None) == (start + len(seq.token_ids) == len(tokens))
            for offset, token in enumerate(seq.token_ids):
                self.kv[self.slot(seq.block_ids, start + offset)] = token
        sampled = []
        for i, seq in enumerate(output.sequences):
            tokens = self.tokens[seq.request_id]
            for position in range(seq.num_computed_tokens):  # the cached context holds this request's tokens
                assert self.kv.get(self.slot(seq.block_ids, position)) == tokens[position], (seq.request_id, position)
            if seq.sampling is not None:
                token = (len(seq.token_ids) * 7 + self.step_no * 13 + i) % 50 + (1 if self.step_no % 11 else 0)
                tokens.append(token)
                sampled.append(SampledToken(token_id=token))
        return sampled


def fake_step(scheduler: Scheduler, model: FakeModel, check) -> list[Request]:
    """Schedule, run the fake model (which samples a deterministic token per sampling sequence), update."""
    output = scheduler.schedule()
    check(output)
    return scheduler.update(output, ModelRunnerOutput(model.run(output)))


SHARED_PREFIX = [(i * 7) % 4 + 1 for i in range(48)]  # many requests start with some of it: prefix hits
prompts = st.one_of(
    st.lists(st.integers(1, 4), min_size=1, max_size=60),
    st.builds(lambda n, tail: SHARED_PREFIX[:n] + tail, st.integers(1, 48), st.lists(st.integers(1, 4), max_size=8)),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), prompts, st.integers(1, 20), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 100)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 6),
    max_tokens_budget=st.integers(1, 48),
    caching=st.booleans(),
)
def test_blocks_conserved_budgets_respected(ops, num_blocks, block_size, max_num_seqs, max_tokens_budget, caching):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens_budget)
    scheduler = Scheduler(config, max_model_len=100, kv_cache=kv)
    model = FakeModel(block_size)
    added: list[Request] = []

    def check(output) -> None:
        assert output.num_tokens <= max_tokens_budget
        assert len(output.sequences) <= max_num_seqs
        assert len(scheduler.running) <= max_num_seqs
        kv.check_integrity()

    for op in ops:
        if op[0] == "add":  # n samples: siblings wait for the leader's prompt, as the engine sets up
            _, prompt, max_tokens, n = op
            leader = None
            for i in range(n):
                request = make_request(f"r{len(added)}", prompt, max_tokens, leader=leader)
                try:
                    scheduler.add_request(request)
                except RequestTooLongError:
                    assert kv.blocks_needed(len(prompt) + max_tokens) > num_blocks
                    break
                added.append(request)
                model.add(request)
                leader = leader or request
        elif op[0] == "abort" and added:
            scheduler.finish_request(added[op[1] % len(added)].request_id, RequestStatus.FINISHED_ABORTED)
            kv.check_integrity()
        elif op[0] == "step":
            for _ in range(op[1]):
                fake_step(scheduler, model, check)

    for _ in range(10_000):
        if not scheduler.has_unfinished_requests():
            break
        fake_step(scheduler, model, check)
    assert not scheduler.has_unfinished_requests(), "requests starved"
    for request in added:
        assert request.is_finished
        assert request.output_token_ids == model.tokens[request.request_id][request.num_prompt_tokens:]
        if request.status != RequestStatus.FINISHED_ABORTED:
            assert request.num_output_tokens <= request.max_tokens
    assert kv.pool.num_free_blocks == num_blocks
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    kv.check_integrity()


def test_too_long_request_is_rejected_with_numbers():
    scheduler = Scheduler(SchedulerConfig(), max_model_len=64, kv_cache=KVCacheManager(100, 16))
    with pytest.raises(RequestTooLongError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds max_model_len \(64\)"):
        scheduler.add_request(make_request("a", [1] * 60, 10))
    small_pool = Scheduler(SchedulerConfig(), max_model_len=1000, kv_cache=KVCacheManager(2, 16))
    with pytest.raises(RequestTooLongError, match="needs 3 KV blocks but the cache holds only 2"):
        small_pool.add_request(make_request("b", [1] * 40, 8))
    assert not small_pool.has_unfinished_requests()


def test_decodes_keep_running_during_chunked_prefill():
    kv = KVCacheManager(64, 4)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8), max_model_len=512, kv_cache=kv)
    short = make_request("short", [1, 2, 3], 50)
    scheduler.add_request(short)
    model = FakeModel(4)
    model.add(short)
    fake_step(scheduler, model, lambda o: None)
    scheduler.add_request(make_request("long", list(range(1, 41)), 5))
    for step in range(2, 7):
        output = scheduler.schedule()
        ids = {s.request_id: len(s.token_ids) for s in output.sequences}
        assert ids["short"] == 1  # the decode is never starved by the long prefill
        assert ids["long"] == 7
        scheduler.update(output, ModelRunnerOutput([SampledToken(5) for s in output.sequences if s.sampling is not None]))


def test_preempts_most_recent_and_requeues_at_head():
    kv = KVCacheManager(6, 2, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(), max_model_len=64, kv_cache=kv)
    first, second = make_request("first", [1, 2, 3], 8), make_request("second", [4, 5, 6], 8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted = []
    for step in range(1, 6):
        output = scheduler.schedule()
        preempted += output.preempted_request_ids
        scheduler.update(output, ModelRunnerOutput([SampledToken(9) for s in output.sequences if s.sampling is not None]))
    assert preempted and set(preempted) == {"second"}
    assert scheduler.waiting[0] is second and second.status == RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0


def test_parallel_samples_share_prompt_blocks():
    kv = KVCacheManager(32, 4)
    scheduler = Scheduler(SchedulerConfig(), max_model_len=64, kv_cache=kv)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    leader = make_request("r#0", prompt, 4)
    sibling = make_request("r#1", prompt, 4, leader=leader)
    scheduler.add_request(leader)
    scheduler.add_request(sibling)
    output = scheduler.schedule()
    assert [s.request_id for s in output.sequences] == ["r#0"]  # sibling waits for the prompt's blocks
    scheduler.update(output, ModelRunnerOutput([SampledToken(7)]))
    output = scheduler.schedule()
    sibling_seq = next(s for s in output.sequences if s.request_id == "r#1")
    assert sibling_seq.num_computed_tokens == 12  # three cached blocks reused
    assert kv.block_ids("r#1")[:3] == kv.block_ids("r#0")[:3]
