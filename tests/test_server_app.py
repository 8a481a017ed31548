"""The app in-process (uvicorn on a thread, the tiny engine): internal failures stay inside one request."""

from __future__ import annotations

import copy
import threading

import pytest
import uvicorn
from server_harness import ServerProcess, free_port, read_event, wait_until

import tokenmill.server.serving_completion as serving_completion
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.errors import InvalidParameterError
from tokenmill.server.app import build_app
from tokenmill.server.metrics import ServingMetrics
from tokenmill.server.serving_common import ServerContext


@pytest.fixture
def app_server(tiny_llm, tmp_path):
    metrics = ServingMetrics("tiny")
    ctx = ServerContext(AsyncLLMEngine(tiny_llm.engine, step_observer=metrics.observe_step), "tiny", metrics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started)
    yield ServerProcess(process=None, port=port, log_path=tmp_path / "unused.log")
    server.should_exit = True
    thread.join(30)
    assert tiny_llm.engine.kv_cache.stats().num_used_blocks == 0


def test_the_server_tokenizes_with_its_own_copy_of_the_engines_tokenizer(tiny_llm):
    """HF fast tokenizers are not safe to share across threads: the tokenizer thread has a copy, the
    one the launcher made ahead (while the engine loaded) or else one made here."""
    engine_tokenizer = tiny_llm.engine.tokenizer
    made_here = ServerContext(AsyncLLMEngine(tiny_llm.engine), "tiny", ServingMetrics("tiny"))
    assert made_here.inputs.tokenizer is not engine_tokenizer
    assert made_here.inputs.tokenizer.encode("the mill") == engine_tokenizer.encode("the mill")
    ahead = copy.deepcopy(engine_tokenizer)
    given = ServerContext(AsyncLLMEngine(tiny_llm.engine), "tiny", ServingMetrics("tiny"), own_tokenizer=ahead)
    assert given.inputs.tokenizer is ahead


def test_the_vocabulary_is_scanned_at_start_on_the_tokenizer_thread(tiny_llm, monkeypatch):
    """The longest token (for refusing text that can never fit) is found when the server is built,
    on the thread that owns its tokenizer copy, not in the first request (nor on the event loop)."""
    scans = []
    scan = InputProcessor.max_token_chars.fget
    monkeypatch.setattr(InputProcessor, "max_token_chars",
                        property(lambda self: scans.append(threading.current_thread().name) or scan(self)))
    ctx = ServerContext(AsyncLLMEngine(tiny_llm.engine), "tiny", ServingMetrics("tiny"))
    longest = ctx._max_token_chars.result(timeout=30)
    assert longest == max(len(t) for t in ctx.inputs.tokenizer.get_vocab())
    assert len(scans) == 1 and scans[0].startswith("tokenmill-tokenizer")
    ctx.check_text_length(ctx.max_model_len * longest, "prompt")
    with pytest.raises(InvalidParameterError, match="can fit"):
        ctx.check_text_length(ctx.max_model_len * longest + 1, "prompt")
    assert len(scans) == 1


def _fail_call(monkeypatch, target, name: str, *failing_calls: int) -> None:
    real = getattr(target, name)
    calls = {"n": 0}

    def maybe_fail(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in failing_calls:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, maybe_fail)


def test_failed_engine_step_is_500_for_its_request_only(app_server, tiny_llm, monkeypatch):
    _fail_call(monkeypatch, tiny_llm.engine.executor, "execute", 1, 2)  # the step, then its retry alone
    result = app_server.post("/v1/completions", {"prompt": "doomed", "max_tokens": 4})
    assert result.status == 500
    error = result.json()["error"]
    assert error["code"] == 500 and "injected" not in error["message"]  # no internals leak
    assert app_server.post("/v1/completions", {"prompt": "fine", "max_tokens": 4}).status == 200


def test_failure_mid_stream_ends_that_stream_with_an_error_event(app_server, tiny_llm, monkeypatch):
    _fail_call(monkeypatch, tiny_llm.engine.executor, "execute", 3, 4)
    conn, response = app_server.open_stream("/v1/completions",
                                            {"prompt": "stream", "max_tokens": 20, "ignore_eos": True})
    assert response.status == 200
    events = []
    while (event := read_event(response)) not in (None, "[DONE]"):
        events.append(event)
    conn.close()
    assert event == "[DONE]" and events[-1]["error"]["code"] == 500
    assert app_server.post("/v1/completions", {"prompt": "fine", "max_tokens": 4}).status == 200


def test_handler_bug_is_500_and_other_requests_still_work(app_server, monkeypatch):
    _fail_call(monkeypatch, serving_completion, "_response", 1)
    assert app_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status == 500
    chat = app_server.post("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status == 200 and chat.json()["usage"]["completion_tokens"] == 2
    assert app_server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status == 200
