"""EngineProcessClient: the server's end of an engine process (engine_process.py).

It forks the engine process, binds two IPC sockets in a directory only this user can enter, and
waits for the engine's EngineInfo. Then it is an AsyncLLMEngine core: submit() sends commands;
the results are read on the server's event loop once read_on() was called there (else by run());
run(), on a thread of the server's, returns when the engine has stopped: None after a STOP, an
EngineDeadError if the engine died (it said so, or the process is gone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine import wire
from tokenmill.engine.engine_info import EngineInfo, EngineStats
from tokenmill.engine.engine_loop import Command, StepResult
from tokenmill.engine.engine_process import EngineProcessArgs, run_engine_process
from tokenmill.errors import EngineDeadError, InvalidParameterError, ModelLoadError, TokenmillError
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

POLL_MS = 250  # how often run() looks at the process while no message comes
LAST_READ_TIMEOUT = 5.0  # seconds run() waits for the event loop to read what is left at the end
STOP_TIMEOUT = 30.0  # seconds an engine process may take to exit after STOP before it is killed
RUNNING = object()  # follow(): the engine goes on


@dataclass
class RemoteEngine:
    """What the server reads of an engine that runs in another process: its info from the
    handshake, the figures of its latest step, and this process's own tokenizer."""

    info: EngineInfo
    tokenizer: object  # transformers PreTrainedTokenizerFast
    grammars: object  # a GrammarCompiler over `tokenizer`: requests' constraints are checked here first
    latest_stats: EngineStats | None = None

    def __post_init__(self) -> None:
        self.latest_stats = self.latest_stats or self.info.stats

    @property
    def max_model_len(self) -> int:
        return self.info.limits.max_model_len

    @property
    def model_config(self):
        return self.info.model_config

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        return self.info.limits.validate(prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return self.latest_stats

    def facts(self):
        return self.info.facts

    def has_unfinished_requests(self) -> bool:
        return self.latest_stats.num_running + self.latest_stats.num_waiting > 0


class EngineProcessClient:
    """Start with start(); then wait_ready() before handing it to AsyncLLMEngine(core=...)."""

    def __init__(self, args: EngineProcessArgs, process: ForkedProcess, directory: Path | None = None) -> None:
        self.args = args
        self.process = process
        self._directory = directory  # where the IPC sockets' files live until the engine is connected
        self._context, self._commands, self._results = self._open_sockets(args)
        self._poller = zmq.Poller()  # one for every receive: Socket.poll builds and registers a new one each call
        self._poller.register(self._results, zmq.POLLIN)
        self._codec = wire.Codec()
        self._send_lock = threading.Lock()  # submit() runs on the event loop, request_stop() anywhere
        self._stop_sent = False
        self.engine: RemoteEngine | None = None
        self.publish: Callable[[StepResult], None] | None = None
        self.fatal_error: EngineDeadError | None = None
        self._reading_on: asyncio.AbstractEventLoop | None = None  # read_on's loop
        self._dead_read = threading.Event()  # the loop read the engine's DEAD

    def _open_sockets(self, args: EngineProcessArgs) -> tuple[zmq.Context, zmq.Socket | None, zmq.Socket]:
        """(context, commands socket, results socket) bound at the addresses the engine connects to."""
        context = zmq.Context()
        commands = context.socket(zmq.PUSH)
        commands.setsockopt(zmq.SNDHWM, 0)  # never drop a command for a busy engine; see _send
        commands.bind(args.commands_address)
        results = context.socket(zmq.PULL)
        results.bind(args.results_address)
        return context, commands, results

    def _close_sockets(self) -> None:
        self._commands.close(linger=0)
        self._results.close(linger=0)
        self._context.term()
        self._remove_socket_files()

    def _remove_socket_files(self) -> None:
        """Connected sockets live on without their files: removed once the engine is connected, a
        server killed outright (SIGKILL) leaves nothing behind in the temp directory."""
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    @classmethod
    def start(cls, config: EngineConfig, peak_tflops: float | None = None, peak_bandwidth_gbs: float | None = None,
              measure_peaks: bool = True, cpu_cores: list[int] | None = None,
              gpu: int | None = None) -> EngineProcessClient:
        """Fork the engine process: at start-up before this process starts any thread; later (a
        replica's restart) from a thread that lives as long as the server, since the child dies
        with the thread that forked it. The child closes every descriptor it inherited."""
        directory = Path(tempfile.mkdtemp(prefix="tokenmill-engine-"))  # mode 0700: only this user connects
        args = EngineProcessArgs(config, f"ipc://{directory}/commands", f"ipc://{directory}/results",
                                 peak_tflops, peak_bandwidth_gbs, measure_peaks, cpu_cores, gpu)
        # fork, not spawn: nothing is pickled, and what this process set up (logging) carries over
        return cls(args, ForkedProcess.start(run_engine_process, args), directory)

    # ---- start-up ------------------------------------------------------------------------------
    def wait_ready(self, load_tokenizer: Callable[[EngineInfo], object],
                   make_grammars: Callable[[object, EngineInfo], object]) -> RemoteEngine:
        """Block until the engine has loaded its model; raises the engine's error if it could not."""
        while True:
            message = self.receive(POLL_MS)
            if message is None:
                if not self.process.is_alive():
                    raise ModelLoadError(f"the engine process exited during start-up ({_exit_text(self.process)})")
                continue
            kind, payload = message
            if kind == wire.FAILED:
                error = wire.from_wire_error(payload)
                raise error if isinstance(error, TokenmillError) else ModelLoadError(str(error))
            if kind == wire.READY:  # both connections made (the engine waits for its commands one)
                self._remove_socket_files()
                tokenizer = load_tokenizer(payload)
                self.engine = RemoteEngine(payload, tokenizer, make_grammars(tokenizer, payload))
                return self.engine
            logger.warning("engine process: %r before it was ready, ignored", kind)

    # ---- the core's interface --------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        try:
            frames = self._codec.encode(wire.ABORT, command) if isinstance(command, str) else \
                self._codec.encode(wire.ADD, command)
        except (OverflowError, TypeError) as exc:  # what validation let through but msgpack cannot carry
            raise InvalidParameterError(f"the request holds a value the engine cannot take ({exc})") from None
        with self._send_lock:
            if not self._stop_sent:
                self._send(frames)

    def request_stop(self) -> None:
        with self._send_lock:
            if not self._stop_sent:
                self._stop_sent = True
                self._send(self._codec.encode(wire.STOP))

    def _send(self, frames: list[bytes]) -> None:
        """Queue a message for the engine; with no engine connected (it has died) it is dropped,
        never waited on: run() reports the death."""
        try:
            self._commands.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("engine process not connected: %r message dropped", frames[0])

    def run(self) -> EngineDeadError | None:
        """Hand each result to publish until the engine process exits (with read_on: watch the
        process while the event loop reads)."""
        if self._reading_on is not None:
            return self._watch()
        while True:
            outcome = self.follow(self.receive(POLL_MS))
            if outcome is not RUNNING:
                return outcome

    # ---- results read on the event loop ----------------------------------------------------------
    def read_on(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[StepResult], None]) -> None:
        """Read the results on `loop` (call this there), each handed to `deliver` there. Received on
        a thread and handed over with call_soon_threadsafe, every step cost the server a second
        wake-up and a pass of the GIL: ~0.15 ms of CPU per streamed token, on the cores the engine
        decodes on."""
        self.publish = deliver
        self._reading_on = loop
        loop.add_reader(self._results.getsockopt(zmq.FD), self._read_queued)
        loop.call_soon(self._read_queued)  # what came before: the descriptor would not signal it

    def _read_queued(self) -> None:
        """On the loop: every message queued now (the socket's descriptor signals a change, not
        each message). The engine's DEAD is left for run() to act on."""
        try:
            while not self._dead_read.is_set() and self._results.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                kind, payload = self._results.recv_multipart(zmq.NOBLOCK)
                message = kind, self._codec.decode(kind, payload)
                if kind == wire.DEAD:
                    self.fatal_error = self._engine_said_dead(message[1])
                    self._dead_read.set()
                else:
                    self.follow(message)
        except Exception:  # as a failure of run()'s own reading would: the server must not go on half-deaf
            logger.exception("reading the engine's results failed")
            self.fatal_error = EngineDeadError("the server failed to read the engine's results")
            self._dead_read.set()
            self.request_stop()  # the engine exits for run() to report it

    def _watch(self) -> EngineDeadError | None:
        """run() while the loop reads: wait for the process to end or for its DEAD."""
        while not self._dead_read.wait(POLL_MS / 1000) and self.process.is_alive():
            pass
        self._read_the_rest()  # what the engine sent before it ended, a DEAD among it
        if self._dead_read.is_set():
            self.process.join(STOP_TIMEOUT)
            return self.fatal_error
        return self.follow(None)

    def _read_the_rest(self) -> None:
        """Have the loop read what is queued, then stop reading; returns once it has (or when
        the loop is gone: nobody waits for results then)."""
        done = threading.Event()

        def last_read() -> None:
            try:
                self._read_queued()
            finally:
                self._reading_on.remove_reader(self._results.getsockopt(zmq.FD))
                done.set()

        try:
            self._reading_on.call_soon_threadsafe(last_read)
        except RuntimeError:  # the loop has closed
            return
        done.wait(LAST_READ_TIMEOUT)

    def follow(self, message: tuple[bytes, object] | None):
        """Act on one message (None: none came): RUNNING while the engine goes on; None once it
        exited after STOP; the EngineDeadError when it died."""
        if message is None:
            if self.process.is_alive():
                return RUNNING
            if self._stop_sent and self.process.exitcode == 0:
                return None
            self.fatal_error = EngineDeadError(f"the engine process is gone ({_exit_text(self.process)})")
            logger.error("%s", self.fatal_error.message)
            return self.fatal_error
        kind, payload = message
        if kind == wire.STEP:
            self.engine.latest_stats = payload.stats
            self.publish(payload)
        elif kind == wire.PEAKS:  # filled in where the cost model reads them
            self.engine.info.peaks.flops, self.engine.info.peaks.bandwidth = payload.flops, payload.bandwidth
        elif kind == wire.DEAD:
            self.fatal_error = self._engine_said_dead(payload)
            self.process.join(STOP_TIMEOUT)
            return self.fatal_error
        return RUNNING

    @staticmethod
    def _engine_said_dead(payload: wire.WireError) -> EngineDeadError:
        error = wire.from_wire_error(payload)
        return EngineDeadError(error.message if isinstance(error, TokenmillError) else str(error))

    @property
    def results_socket(self) -> zmq.Socket:
        """For a poller that follows several engine processes at once (replica_set.py)."""
        return self._results

    def receive(self, timeout_ms: int = 0) -> tuple[bytes, object] | None:
        if not self._poller.poll(timeout_ms):
            return None
        kind, payload = self._results.recv_multipart()
        return kind, self._codec.decode(kind, payload)

    def shutdown(self) -> None:
        """Stop the engine process (killed if it does not exit in time) and remove the sockets."""
        if self._results.closed:
            return
        if self.process.is_alive():
            self.request_stop()
            self.process.join(STOP_TIMEOUT)
            if self.process.is_alive():
                logger.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT)
                self.process.kill()
                self.process.join()
        self._close_sockets()


class ForkedProcess:
    """A child made by os.fork that runs target(arg) and exits with its status (multiprocessing's
    Process would join or SIGTERM it at interpreter exit; this one is stopped by its owner, and
    dies with it through PR_SET_PDEATHSIG)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    @classmethod
    def start(cls, target: Callable[[object], None], arg) -> ForkedProcess:
        pid = os.fork()
        if pid == 0:  # the child: never returns into the parent's code
            code = 1
            # Nothing the parent had open is the child's: a client connection or the listening
            # socket held here would outlive the server's close of it (a restart forks a serving process).
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            try:
                target(arg)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                logger.exception("the engine process failed")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        return cls(pid)

    def is_alive(self) -> bool:
        if self.exitcode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid != 0:
                self.exitcode = os.waitstatus_to_exitcode(status)
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.02)

    def kill(self) -> None:
        if self.is_alive():
            os.kill(self.pid, signal.SIGKILL)


def _exit_text(process: ForkedProcess) -> str:
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"
