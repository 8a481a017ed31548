"""The engine process: an LLMEngine and its EngineLoop, fed and read over ZeroMQ (wire.py).

Started by EngineProcessClient (engine_client.py), forked before the server has loaded anything
or started any thread (a replica's restart forks later, from the server's run thread). Its main thread steps the engine (torch runs faster there); one thread
reads commands. It ignores SIGINT/SIGTERM: the server drains first, then sends STOP; if the server
process dies, so does this one (PR_SET_PDEATHSIG, and a check of the parent while idle).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, replace

import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine import wire
from tokenmill.engine.device_peaks import DevicePeaks, known_peaks, measure_cpu_when_idle
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.engine_loop import EngineLoop, without_prompts
from tokenmill.errors import ModelLoadError

logger = logging.getLogger("tokenmill.engine")

PR_SET_PDEATHSIG = 1
CONNECT_TIMEOUT_MS = 10_000  # the server binds right after forking this process: only a broken server takes long


@dataclass
class EngineProcessArgs:
    """What the engine process is started with (inherited through fork: nothing is serialized)."""

    config: EngineConfig
    commands_address: str  # ipc://... the server binds; this process reads commands from it
    results_address: str  # ipc://... this process sends results to
    peak_tflops: float | None = None
    peak_bandwidth_gbs: float | None = None
    measure_peaks: bool = True  # a CPU engine measures the CPU's peaks while idle, unless both are given
    cpu_cores: list[int] | None = None  # run on these CPUs only, one torch thread each (a data-parallel replica)
    gpu: int | None = None  # a data-parallel replica's GPU: the one CUDA device this process sees


def run_engine_process(args: EngineProcessArgs) -> None:
    """The engine process's whole life; its exit status is 0 after STOP, 1 if it failed or died."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    _die_with_parent()
    if args.gpu is not None:  # before anything initializes CUDA here
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(args.gpu + 1)]
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[args.gpu].strip()
    if args.cpu_cores:
        os.sched_setaffinity(0, args.cpu_cores)
        os.environ["OMP_NUM_THREADS"] = str(len(args.cpu_cores))  # set_cpu_threads' budget
    context = zmq.Context()
    results = context.socket(zmq.PUSH)
    results.connect(args.results_address)
    commands = context.socket(zmq.PULL)
    commands_connected = commands.get_monitor_socket(zmq.EVENT_CONNECTED)
    commands.connect(args.commands_address)
    codec = wire.Codec()
    send_lock = threading.Lock()  # the results socket is shared by the loop and the peaks probe

    def send(kind: bytes, payload=None) -> None:
        frames = codec.encode(kind, payload)
        with send_lock:
            results.send_multipart(frames)

    status = 1
    reader = CommandReader(commands, codec)
    try:
        try:
            engine = serving_engine(args.config)
        except Exception as exc:
            logger.debug("engine start failed", exc_info=exc)
            send(wire.FAILED, wire.to_wire_error(exc))
            return
        if not _connected(commands, commands_connected, CONNECT_TIMEOUT_MS):
            send(wire.FAILED, wire.to_wire_error(ModelLoadError("the engine process could not connect to the server")))
            return
        status = _serve(engine, args, send, reader, parent)
    finally:
        reader.stop()
        commands_connected.close(linger=0)  # else context.term() would wait for it
        commands.close(linger=0)
        results.close(linger=2000)  # the last messages (DEAD) still reach the server
        context.term()
        sys.exit(status)


def serving_engine(config: EngineConfig):
    """The LLMEngine of an engine process or a Ray replica. Its server tokenizes: prompts arrive as
    token ids, so the engine's tokenizer only decodes (and loads without transformers)."""
    from tokenmill.engine.engine_core import LLMEngine  # torch is imported here, not in the server

    return LLMEngine(replace(config, decodes_only=True))


def _serve(engine, args: EngineProcessArgs, send, reader: CommandReader, parent: int) -> int:
    loop = EngineLoop(engine, lambda result: send(wire.STEP, without_prompts(result)))
    peaks = known_peaks(engine.device, args.peak_tflops, args.peak_bandwidth_gbs)
    send(wire.READY, engine_info(engine, peaks))
    reader.start(loop)
    probe = None
    if args.measure_peaks and engine.device.type == "cpu":
        probe = measure_cpu_when_idle(peaks, lambda: loop.is_idle, args.peak_tflops, args.peak_bandwidth_gbs,
                                      on_measured=lambda measured: send(wire.PEAKS, measured))
    try:
        fatal = loop.run(still_wanted=lambda: os.getppid() == parent)
    finally:
        if probe is not None:
            probe.stop()
        engine.shutdown()
    if fatal is not None:
        send(wire.DEAD, wire.to_wire_error(fatal))
        return 1
    return 0


def engine_info(engine, peaks: DevicePeaks) -> EngineInfo:
    return EngineInfo(
        model_path=str(engine.model_path), model_config=engine.model_config,
        dtype=str(engine.dtype).removeprefix("torch."), device=str(engine.device), limits=engine.limits,
        facts=engine.facts(), stats=engine.stats(), peaks=peaks,
        kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."))


class CommandReader:
    """The thread that hands each command to the loop; STOP ends it (so does stop())."""

    POLL_MS = 200

    def __init__(self, socket, codec: wire.Codec) -> None:
        self.socket = socket
        self.codec = codec
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: EngineLoop) -> None:
        self._thread = threading.Thread(target=self._run, args=(loop,), name="tokenmill-commands", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Wait for the thread to let go of the socket (within one poll)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self, loop: EngineLoop) -> None:
        while not self._stopping.is_set():
            if not self.socket.poll(self.POLL_MS):
                continue
            kind, payload = self.socket.recv_multipart()
            if kind == wire.STOP:
                loop.request_stop()
                return
            try:
                loop.submit(self.codec.decode(kind, payload))
            except Exception:  # a message we cannot read is the server's bug: say so, keep serving
                logger.exception("engine process: unreadable %r message", kind[:16])


def _connected(socket: zmq.Socket, monitor: zmq.Socket, timeout_ms: int) -> bool:
    """Whether `socket` has connected (within timeout_ms). READY waits for it: once READY arrives the
    server removes the socket files, which a connection still being made would need."""
    try:
        return bool(monitor.poll(timeout_ms))
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the server that forked it exits (elsewhere: the idle
    check of the parent pid does it)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass

