"""The engine in its own process: the wire's typed messages, and a real `tokenmill serve` whose
engine process is killed, signalled, or outlived by its server."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from server_harness import child_pids, free_port, read_event, start_server, wait_until

from tokenmill.engine import engine_process, wire
from tokenmill.engine.engine_info import EngineStats
from tokenmill.engine.engine_loop import AddCommand, StepResult, without_prompts
from tokenmill.engine.kv_cache_manager import KVCacheStats
from tokenmill.engine.metrics import StepStats
from tokenmill.errors import InvalidParameterError, RequestTooLongError
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


def _stats() -> EngineStats:
    kv = KVCacheStats(64, 3, 61, 3 / 64, 48, 40, 1 - 40 / 48, 10, 4)
    return EngineStats(2, 1, 0, kv, num_steps=7, last_step=StepStats(1.0, 0.02, 2, 9, 2, 40, 30, 7))


def test_step_results_cross_the_wire_whole():
    codec = wire.Codec()
    output = RequestOutput(
        "cmpl-1", None, [1, 2, 3],
        [CompletionOutput(0, " mill", [17], logprobs=[{17: Logprob(-0.25, 1, " mill"), 9: Logprob(-2.0, 2, " m")}]),
         CompletionOutput(1, "", [], finish_reason="stop", stop_reason="\n")],
        finished=False, metrics=RequestMetrics(10.0, 10.1, 10.2), num_cached_tokens=16,
        prompt_logprobs=[None, {2: Logprob(-1.5, 3, "b")}])
    failed = RequestOutput("cmpl-2", "p", [5], [], True, RequestMetrics(11.0),
                           error=RequestTooLongError("too long", param="max_tokens"))
    result = StepResult(12.5, [output, failed], _stats(),
                        {"cmpl-3": InvalidParameterError("bad grammar", param="response_format"),
                         "cmpl-4": ZeroDivisionError("division by zero")})
    back = codec.decode(*codec.encode(wire.STEP, result))
    assert back.outputs[0] == output and back.stats == result.stats and back.end_time == 12.5
    error = back.outputs[1].error
    assert type(error) is RequestTooLongError and error.message == "too long" and error.param == "max_tokens"
    assert type(back.errors["cmpl-3"]) is InvalidParameterError and back.errors["cmpl-3"].param == "response_format"
    # not one of ours: a plain RuntimeError (the server answers 500 "internal server error" for it)
    assert type(back.errors["cmpl-4"]) is RuntimeError and "ZeroDivisionError" in str(back.errors["cmpl-4"])


def test_commands_cross_the_wire_whole():
    codec = wire.Codec()
    params = SamplingParams(n=2, temperature=0.7, top_k=40, logit_bias={5: -3.0}, stop=["\n\n"], seed=-(2 ** 62),
                            stop_token_ids=[2], logprobs=3, structured_outputs=StructuredOutputsParams(
                                json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    command = AddCommand("chatcmpl-9", [1, 2, 3], params, "the prompt", 123.25)
    back = codec.decode(*codec.encode(wire.ADD, command))
    assert back == command and back.params.stop_strings == ["\n\n"]
    assert codec.decode(*codec.encode(wire.ABORT, "chatcmpl-9")) == "chatcmpl-9"


def test_the_wire_decodes_only_the_type_its_kind_names():
    codec = wire.Codec()
    kind, payload = codec.encode(wire.STEP, StepResult(1.0, [], _stats(), {}))
    with pytest.raises(msgspec.ValidationError):
        codec.decode(wire.ADD, payload)  # a step result is not a command
    with pytest.raises(msgspec.DecodeError):
        codec.decode(wire.ADD, pickle.dumps(AddCommand("x", [1], SamplingParams(), None, 0.0)))
    with pytest.raises(ValueError, match="unknown engine message"):
        codec.decode(b"exec", payload)


def _engine_pid(server) -> int:
    children = child_pids(server.process.pid)
    assert len(children) == 1, children  # the engine process, and nothing else
    return children[0]


def _complete(server, prompt: str) -> str:
    response = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                               "ignore_eos": True})
    assert response.status == 200, response.body
    return response.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def engine_server(tiny_llama_dir, tmp_path_factory):
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path_factory.mktemp("engine"))
    yield server
    server.stop()


def test_the_engine_runs_in_its_own_process_and_ignores_terminal_signals(engine_server):
    engine_pid = _engine_pid(engine_server)
    before = _complete(engine_server, "The mill turns")
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C to the process group: the server drains, not the engine
        os.kill(engine_pid, sig)
    time.sleep(0.5)
    assert _complete(engine_server, "The mill turns") == before
    assert _engine_pid(engine_server) == engine_pid


def test_a_gguf_models_server_process_never_loads_torch(tmp_path):
    """torch (~220 MB resident) is the engine process's alone. (An HF directory's tokenizer goes
    through transformers' AutoTokenizer, which imports torch; a GGUF's cached one does not.)"""
    server = start_server(["--max-model-len", "512"], tmp_path)
    try:
        engine_pid = _engine_pid(server)
        assert _complete(server, "The mill turns")
        assert "libtorch" in Path(f"/proc/{engine_pid}/maps").read_text()
        assert "libtorch" not in Path(f"/proc/{server.process.pid}/maps").read_text()
    finally:
        assert server.stop() == 0


def test_in_process_engine_gives_the_same_tokens(engine_server, tiny_llama_dir, tmp_path):
    expected = _complete(engine_server, "Water runs under the")
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--no-engine-process"], tmp_path)
    try:
        assert child_pids(server.process.pid) == []
        assert _complete(server, "Water runs under the") == expected
    finally:
        assert server.stop() == 0


def test_a_killed_engine_process_fails_in_flight_requests_and_ends_the_server(tiny_llama_dir, tmp_path):
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path)
    try:
        engine_pid = _engine_pid(server)
        conn, running = server.open_stream("/v1/completions", {"prompt": "a long one", "max_tokens": 480,
                                                               "ignore_eos": True})
        assert read_event(running)["choices"]
        os.kill(engine_pid, signal.SIGKILL)
        events = []
        while (event := read_event(running)) not in (None, "[DONE]"):
            events.append(event)
        conn.close()
        assert events[-1]["error"]["type"] == "engine_dead"
        assert "killed by signal 9" in events[-1]["error"]["message"]
        statuses = set()
        while server.process.poll() is None:
            try:
                statuses.add(server.request("GET", "/health", timeout=2).status)
                statuses.add(server.request("GET", "/ready", timeout=2).status)
                statuses.add(server.post("/v1/completions", {"prompt": "anyone?", "max_tokens": 2}, timeout=2).status)
            except OSError:
                pass
            time.sleep(0.05)
        assert statuses == {503}
        assert server.process.wait(10) == 1  # for the supervisor to restart us
    finally:
        server.stop()
    assert "the engine process is gone (killed by signal 9)" in server.log()


def test_the_engine_process_does_not_outlive_its_server(tiny_llama_dir, tmp_path):
    temp = Path(tempfile.mkdtemp(prefix="tm-"))  # short: a socket's path has at most 107 bytes
    server = None
    try:
        server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path,
                              env={"TMPDIR": str(temp)})
        engine_pid = _engine_pid(server)
        assert list(temp.iterdir()) == []  # the sockets' files went once the engine had connected
        assert _complete(server, "A paged cache holds")
        server.stop(signal.SIGKILL)  # no drain, no STOP: the kernel tells the engine (PR_SET_PDEATHSIG)
        assert wait_until(lambda: not os.path.exists(f"/proc/{engine_pid}") or _is_zombie(engine_pid), 10)
        assert list(temp.iterdir()) == []
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)  # a failed assertion above leaves no server running
        shutil.rmtree(temp)


def test_the_engine_says_ready_only_once_its_commands_socket_is_connected():
    """The server removes the sockets' files on READY: a connection not yet made then never would be."""
    temp = Path(tempfile.mkdtemp(prefix="tm-"))
    context = zmq.Context()
    try:
        address = f"ipc://{temp}/commands"
        alone = context.socket(zmq.PULL)
        monitor = alone.get_monitor_socket(zmq.EVENT_CONNECTED)
        alone.connect(address)
        assert not engine_process._connected(alone, monitor, 300)  # nobody bound there
        alone.close(linger=0)  # else, still retrying, it would connect and take its share of what is sent
        engine_side = context.socket(zmq.PULL)
        monitor = engine_side.get_monitor_socket(zmq.EVENT_CONNECTED)
        engine_side.connect(address)  # before the server binds, as a fork can
        server_side = context.socket(zmq.PUSH)
        server_side.bind(address)
        assert engine_process._connected(engine_side, monitor, 5000)
        shutil.rmtree(temp)
        server_side.send(b"after the files went")
        assert engine_side.poll(5000) and engine_side.recv() == b"after the files went"
    finally:
        context.destroy(linger=0)  # closes what a failed assertion left open
        shutil.rmtree(temp, ignore_errors=True)


def test_a_drained_server_stops_its_engine_process(tiny_llama_dir, tmp_path):
    server = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path)
    engine_pid = _engine_pid(server)
    assert _complete(server, "A paged cache holds")
    assert server.stop(signal.SIGTERM) == 0
    assert not os.path.exists(f"/proc/{engine_pid}") or _is_zombie(engine_pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_engine_that_cannot_load_is_a_one_line_error(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(broken),
                             "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill: error: ") and "broken.gguf" in last
    assert "Traceback" not in result.stderr
    assert "did not stop" not in result.stderr  # the failed engine process exits by itself


class _PromptlessCore:
    """An engine core that answers each add with one final output whose prompt it left out, as an
    engine process does (without_prompts)."""

    engine = None
    publish = None

    def submit(self, command) -> None:
        if isinstance(command, AddCommand):
            output = RequestOutput(command.request_id, command.prompt_text, list(command.prompt_token_ids),
                                   [CompletionOutput(0, " done", [7], finish_reason="length")], True,
                                   RequestMetrics(command.arrival_time, first_token_time=command.arrival_time))
            result = wire.Codec().decode(*wire.Codec().encode(wire.STEP, without_prompts(
                StepResult(1.0, [output], _stats(), {}))))
            assert result.outputs[0].prompt_token_ids == [] and result.outputs[0].prompt is None
            self.publish(result)

    def request_stop(self) -> None:
        pass

    def run(self):
        return None


def test_outputs_cross_without_their_prompts_and_get_them_back():
    import asyncio

    from tokenmill.engine.async_engine import AsyncLLMEngine

    async def body():
        engine = AsyncLLMEngine(core=_PromptlessCore())
        engine.attach()
        outputs = [o async for o in engine.generate("r1", list(range(300)), SamplingParams(), prompt_text="text")]
        assert engine._prompts == {}  # nothing kept once the request has ended
        return outputs

    (output,) = asyncio.run(body())
    assert output.prompt_token_ids == list(range(300)) and output.prompt == "text"
    assert output.outputs[0].text == " done"


class _FakeProcess:
    """An engine process as the client sees it, ended when the test says."""

    def __init__(self) -> None:
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        pass


def _client_reading_on_a_loop(tmp_path: Path):
    """(client, engine's end of the results socket, loop, the loop's thread, delivered results)."""
    import asyncio
    import threading

    import zmq

    from tokenmill.engine.engine_client import EngineProcessClient, RemoteEngine
    from tokenmill.engine.engine_process import EngineProcessArgs

    args = EngineProcessArgs(None, f"ipc://{tmp_path}/commands", f"ipc://{tmp_path}/results")
    client = EngineProcessClient(args, _FakeProcess(), tmp_path / "gone-at-shutdown")
    client.engine = RemoteEngine(info=None, tokenizer=None, grammars=None, latest_stats=_stats())
    engine_end = zmq.Context.instance().socket(zmq.PUSH)
    engine_end.connect(args.results_address)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    delivered = []
    ready = threading.Event()

    def attach() -> None:
        client.read_on(loop, lambda result: delivered.append((threading.get_ident(), result)))
        ready.set()

    loop.call_soon_threadsafe(attach)
    assert ready.wait(5)
    return client, engine_end, loop, thread, delivered


def _stop_loop(client, engine_end, loop, thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
    engine_end.close(linger=0)
    client._close_sockets()


@pytest.mark.parametrize("ending", ["stop", "dead", "killed"])
def test_results_read_on_the_event_loop_arrive_there_and_the_end_is_reported(tmp_path, ending):
    """With read_on, each step's result is delivered on the loop's own thread, in order, with no
    thread in between; run() returns None after a STOP, the engine's own DEAD message (even when
    the process is already gone by the time run() looks), or 'gone' for a process that just died."""
    from tokenmill.errors import EngineDeadError

    client, engine_end, loop, thread, delivered = _client_reading_on_a_loop(tmp_path)
    codec = wire.Codec()
    try:
        for i in range(3):
            engine_end.send_multipart(codec.encode(wire.STEP, StepResult(float(i), [], _stats(), {})))
        assert wait_until(lambda: len(delivered) == 3, 5)
        assert {ident for ident, _ in delivered} == {thread.ident}
        assert [result.end_time for _, result in delivered] == [0.0, 1.0, 2.0]
        if ending == "stop":
            client._stop_sent = True
            engine_end.send_multipart(codec.encode(wire.STEP, StepResult(3.0, [], _stats(), {})))
            client.process.exitcode = 0
        elif ending == "dead":
            engine_end.send_multipart(codec.encode(wire.DEAD, wire.to_wire_error(EngineDeadError("out of luck"))))
            client.process.exitcode = 1
        else:
            client.process.exitcode = -9
        outcome = client.run()
        if ending == "stop":
            assert outcome is None and len(delivered) == 4  # what came before the exit was read
        elif ending == "dead":
            assert isinstance(outcome, EngineDeadError) and outcome.message == "out of luck"
        else:
            assert isinstance(outcome, EngineDeadError) and "gone" in outcome.message
        engine_end.send_multipart(codec.encode(wire.STEP, StepResult(9.0, [], _stats(), {})))
        time.sleep(0.2)
        assert all(result.end_time != 9.0 for _, result in delivered)  # run() ended the reading
    finally:
        _stop_loop(client, engine_end, loop, thread)
