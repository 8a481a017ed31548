"""Injected faults in a real `tokenmill serve`: a dead engine loop is loud (503s, error events, exit 1)."""

from __future__ import annotations

import time

from server_harness import read_event, start_server

# Kills the engine loop (outside engine.step) when a request with this prompt arrives.
KILL_ENGINE_LOOP = '''
from tokenmill.engine import async_engine
_real_apply = async_engine.AsyncLLMEngine._apply
def _apply(self, commands):
    if any(getattr(c, "prompt_text", None) == "kill the engine loop" for c in commands):
        raise RuntimeError("injected engine-loop failure")
    return _real_apply(self, commands)
async_engine.AsyncLLMEngine._apply = _apply
'''


def test_a_dead_engine_loop_fails_everything_at_once_and_exits_nonzero(tiny_llama_dir, tmp_path):
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path, prelude=KILL_ENGINE_LOOP)
    try:
        conn, running = server.open_stream("/v1/completions", {"prompt": "a long one", "max_tokens": 480,
                                                               "ignore_eos": True})
        assert read_event(running)["choices"]
        killer = server.post("/v1/completions", {"prompt": "kill the engine loop", "max_tokens": 4})
        assert killer.status == 503 and killer.json()["error"]["type"] == "engine_dead"
        events = []
        while (event := read_event(running)) not in (None, "[DONE]"):
            events.append(event)
        assert events[-1]["error"]["type"] == "engine_dead"  # the stream in flight ends with an error at once
        conn.close()
        statuses = set()
        deadline = time.time() + 10
        while server.process.poll() is None and time.time() < deadline:
            try:
                statuses.add(server.request("GET", "/health", timeout=2).status)
                statuses.add(server.post("/v1/completions", {"prompt": "anyone?", "max_tokens": 2}, timeout=2).status)
            except OSError:
                pass
            time.sleep(0.05)
        assert statuses == {503}  # /health and new requests, until the process is gone
        assert server.process.wait(10) == 1
    finally:
        server.stop()
    log = server.log()
    assert "the engine loop failed" in log and "injected engine-loop failure" in log
