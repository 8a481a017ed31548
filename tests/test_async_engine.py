"""AsyncLLMEngine: the step loop on its own thread, streams, cancellation, failures, drain."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import wait_until

from tokenmill import SamplingParams
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.errors import ServerBusyError
from tokenmill.outputs import merge_deltas

PROMPTS = ["The mill turns", "Water runs under the", "Grain becomes flour when", "A paged cache holds"]


def run(coro):
    return asyncio.run(coro)


async def _with_engine(engine, body, **kwargs):
    async_engine = AsyncLLMEngine(engine, **kwargs)
    async_engine.start()
    try:
        return await body(async_engine)
    finally:
        await async_engine.shutdown()


async def _stream_text(async_engine, request_id, prompt_ids, params):
    """The text pieces joined, and all the delta outputs merged into one."""
    pieces, final = [], None
    async for output in async_engine.generate(request_id, prompt_ids, params):
        pieces.append(output.outputs[0].text)
        final = output if final is None else merge_deltas(final, output)
    return "".join(pieces), final


def test_concurrent_streams_match_offline_generate(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    engine = tiny_llm.engine
    prompt_ids = [engine.tokenize(p) for p in PROMPTS]
    observed_steps = []

    async def body(async_engine):
        return await asyncio.gather(*[
            _stream_text(async_engine, f"r{i}", ids, params) for i, ids in enumerate(prompt_ids)
        ])

    results = run(_with_engine(engine, body, step_observer=lambda *a: observed_steps.append(a)))
    for (joined, final), text in zip(results, expected):
        assert joined == text == final.outputs[0].text
        assert final.finished and len(final.outputs[0].token_ids) == 24
    assert observed_steps and all(len(step) == 3 for step in observed_steps)
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_leaving_a_stream_aborts_and_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def body(async_engine):
        stream = async_engine.generate("leaver", engine.tokenize(PROMPTS[0]), params)
        async for output in stream:
            if len(output.outputs[0].token_ids) >= 3:
                break
        await stream.aclose()
        await asyncio.sleep(0)
        return await asyncio.to_thread(wait_until, lambda: not engine.has_unfinished_requests())

    assert run(_with_engine(engine, body))
    assert engine.kv_cache.stats().num_used_blocks == 0
    engine.kv_cache.check_integrity()


def test_a_failing_request_fails_alone_and_the_rest_of_its_step_goes_on(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS[1:], params, use_tqdm=False)]
    doomed_prompt = engine.tokenize(PROMPTS[0])
    real_execute = engine.executor.execute
    failed_batches = []

    def execute(scheduler_output):  # a kernel that fails whenever the doomed request is in the batch
        if any(s.token_ids == doomed_prompt for s in scheduler_output.sequences):
            failed_batches.append(len(scheduler_output.sequences))
            raise RuntimeError("simulated kernel failure")
        return real_execute(scheduler_output)

    monkeypatch.setattr(engine.executor, "execute", execute)

    async def body(async_engine):
        others = [_stream_text(async_engine, f"fine{i}", engine.tokenize(p), params) for i, p in enumerate(PROMPTS[1:])]
        return await asyncio.gather(_stream_text(async_engine, "doomed", doomed_prompt, params), *others,
                                    return_exceptions=True)

    doomed, *fine = run(_with_engine(engine, body))
    assert isinstance(doomed, RuntimeError) and "simulated kernel failure" in str(doomed)
    assert max(failed_batches) > 1  # it shared a step with others, who were retried alone and went on
    assert [final.outputs[0].token_ids for _, final in fine] == expected
    assert engine.kv_cache.stats().num_used_blocks == 0
    engine.kv_cache.check_integrity()


def test_a_transient_step_failure_is_retried(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    real_execute = engine.executor.execute
    calls = {"n": 0}

    def execute_failing_once(scheduler_output):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated glitch")
        return real_execute(scheduler_output)

    monkeypatch.setattr(engine.executor, "execute", execute_failing_once)
    outputs = tiny_llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert calls["n"] > 3 and [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]


def test_waiting_queue_limit(tiny_llm):
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=4)

    async def body(async_engine):
        first = async_engine.generate("a", engine.tokenize(PROMPTS[0]), params)
        task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)  # the generator registers its request
        with pytest.raises(ServerBusyError, match="queue is full"):
            async_engine.check_capacity()
        await task
        await first.aclose()

    run(_with_engine(engine, body, max_queued_requests=1))


def test_drain_waits_then_aborts_the_rest(tiny_llm):
    engine = tiny_llm.engine
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    endless = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def body(async_engine):
        done = asyncio.ensure_future(_stream_text(async_engine, "short", engine.tokenize(PROMPTS[0]), short))
        await asyncio.sleep(0)  # the request is in flight
        assert await async_engine.drain(timeout=5.0) == 0
        _, final = await done
        assert final.finished
        slow = asyncio.ensure_future(_stream_text(async_engine, "long", engine.tokenize(PROMPTS[1]), endless))
        assert await asyncio.to_thread(wait_until, engine.has_unfinished_requests)  # in flight
        aborted = await async_engine.drain(timeout=0.0)
        with pytest.raises(ServerBusyError, match="shutting down"):
            await slow
        return aborted

    assert run(_with_engine(engine, body)) == 1
    assert wait_until(lambda: not engine.has_unfinished_requests())
    assert engine.kv_cache.stats().num_used_blocks == 0


def test_an_abort_while_the_reader_holds_an_output_still_reaches_it(tiny_llm):
    """The drain fails a stream while its reader is busy with the output before (suspended in the
    `async for` body): the next read raises the error; the stream never ends as if it had finished."""
    engine = tiny_llm.engine
    endless = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def body(async_engine):
        outputs = []
        with pytest.raises(ServerBusyError, match="shutting down"):
            async for output in async_engine.generate("long", engine.tokenize(PROMPTS[1]), endless):
                outputs.append(output)
                if len(outputs) == 1:
                    assert await async_engine.drain(timeout=0.0) == 1
        return outputs

    outputs = run(_with_engine(engine, body))
    assert len(outputs) == 1 and not outputs[0].finished
    assert wait_until(lambda: not engine.has_unfinished_requests())
    assert engine.kv_cache.stats().num_used_blocks == 0
