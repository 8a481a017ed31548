"""Injected faults in a real `tokenmill serve`: a dead engine loop is loud (503s, error events, exit 1)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from server_harness import read_event, start_server, wait_until

# Kills the engine loop (outside engine.step) when a request with this prompt arrives.
KILL_ENGINE_LOOP = '''
from tokenmill.engine import engine_loop
_real_apply = engine_loop.EngineLoop._apply
def _apply(self, commands):
    if any(getattr(c, "prompt_text", None) == "kill the engine loop" for c in commands):
        raise RuntimeError("injected engine-loop failure")
    return _real_apply(self, commands)
engine_loop.EngineLoop._apply = _apply
'''


# A tokenizer that takes 1.5 s for one prompt, as a huge prompt would; it touches a file when it starts.
SLOW_TOKENIZER = '''
import pathlib, time
from tokenmill.engine import input_processor
_real_tokenize = input_processor.InputProcessor.tokenize
def tokenize(self, prompt, add_special_tokens=True):
    if prompt == "slow to tokenize":
        pathlib.Path(MARKER).touch()
        time.sleep(1.5)
    return _real_tokenize(self, prompt, add_special_tokens)
input_processor.InputProcessor.tokenize = tokenize
'''


def test_tokenizing_runs_off_the_event_loop(tiny_llama_dir, tmp_path):
    marker = tmp_path / "tokenizing"
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path,
                          prelude=f"MARKER = {str(marker)!r}\n{SLOW_TOKENIZER}")
    try:
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(server.post, "/tokenize", {"prompt": "slow to tokenize"})
            assert wait_until(marker.exists, 10)  # the slow call has started: /health must not wait for it
            start = time.perf_counter()
            assert server.request("GET", "/health").status == 200
            health_seconds = time.perf_counter() - start
            assert slow.result().status == 200
        assert health_seconds < 0.5
    finally:
        assert server.stop() == 0


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
