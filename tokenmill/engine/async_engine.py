"""AsyncLLMEngine: an engine's outputs as asyncio streams, for the server.

The engine runs elsewhere: on a thread of this process (an EngineLoop, the default here) or in
an engine process of its own (EngineProcessClient, what `tokenmill serve` uses). Either way the
event loop hands it add/abort commands with submit() and gets back each step's outputs in one
call (call_soon_threadsafe from the engine's thread; an engine process's results are read on the
loop itself), so HTTP never waits for a forward pass and a forward pass never waits for HTTP.
(Torch releases the GIL inside its kernels, which is where a step spends its time.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.engine.engine_info import EngineStats
from tokenmill.engine.engine_loop import AddCommand, Command, EngineLoop, StepResult
from tokenmill.errors import EngineDeadError, InvalidParameterError, ServerBusyError, StreamStalledError, TokenmillError
from tokenmill.outputs import RequestOutput, merge_deltas
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called on the event loop after every engine step: (step end time, outputs, engine stats).
StepObserver = Callable[[float, list[RequestOutput], EngineStats], None]


class EngineCore(Protocol):
    """Where the engine runs, as AsyncLLMEngine sees it: EngineLoop (a thread of this process) or
    EngineProcessClient (an engine process)."""

    engine: object  # what the server reads: tokenizer, limits, stats(), facts(), ...
    publish: Callable[[StepResult], None]

    def submit(self, command: Command) -> None: ...

    def request_stop(self) -> None: ...

    def run(self) -> EngineDeadError | None: ...

    # optional: read_on(loop, deliver), results read on the event loop itself (EngineProcessClient)


DEFAULT_STALL_TIMEOUT = 60.0  # seconds an output may wait for its reader before the request is aborted


@dataclass
class _Stream:
    """What one request's handler has not read yet: all of it merged into one delta output, so a
    slow reader costs O(new tokens), never a copy per step."""

    num_seqs: int
    pending: RequestOutput | None = None
    error: BaseException | None = None
    unread_since: float | None = None  # when `pending` began to wait
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    has_output: bool = False
    finished: bool = False


class AsyncLLMEngine:
    """Serve an LLMEngine to asyncio code: `async for output in engine.generate(...)`.

    Leaving the loop early (client gone, task cancelled) aborts the request and frees its KV
    blocks on the engine's next iteration.
    """

    def __init__(
        self,
        engine=None,
        max_queued_requests: int | None = None,
        step_observer: StepObserver | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        core: EngineCore | None = None,
    ) -> None:
        """Give an LLMEngine (it will step on a thread of this process) or a `core` that runs one."""
        if (engine is None) == (core is None):
            raise TypeError("give exactly one of engine and core")
        self.core: EngineCore = core if core is not None else EngineLoop(engine, self._publish)
        self.core.publish = self._publish
        self.max_queued_requests = max_queued_requests  # counted in sequences (prompts x n)
        self.step_observer = step_observer
        self.stall_timeout = stall_timeout
        self._streams: dict[str, _Stream] = {}
        # each request's prompt until its last output: what an engine process leaves out of its outputs
        self._prompts: dict[str, tuple[list[int], str | None]] = {}
        self._thread: threading.Thread | None = None
        self._attached = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self.fatal_error: EngineDeadError | None = None  # set when the engine stopped for good

    @property
    def engine(self):
        """The engine as the server reads it (an LLMEngine, or an engine process's view of one)."""
        return self.core.engine

    # ---- lifecycle -----------------------------------------------------------------------------
    def attach(self) -> None:
        """Bind to the running event loop (the one whose tasks read the outputs)."""
        self._loop = asyncio.get_running_loop()
        read_on = getattr(self.core, "read_on", None)  # an engine process's results: read on this loop
        if read_on is not None:
            read_on(self._loop, self._deliver)
        self._idle.set()
        self._attached.set()

    def start(self) -> None:
        """attach(), then run the engine loop on a new thread."""
        self.attach()
        self._thread = threading.Thread(target=self.run_engine_loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def wait_attached(self, timeout: float) -> bool:
        return self._attached.wait(timeout)

    def request_stop(self) -> None:
        """Make run_engine_loop() return after the commands already queued have run (thread-safe)."""
        self.core.request_stop()

    async def shutdown(self) -> None:
        """Abort everything still running and stop the engine loop."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self.request_stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    async def drain(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for in-flight requests to finish, then abort the rest.

        Returns how many requests were aborted.
        """
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return 0
        except asyncio.TimeoutError:
            remaining = list(self._streams)
            for request_id in remaining:
                self._fail(request_id, ServerBusyError("the server is shutting down; request aborted"))
                self.abort(request_id)
            for _ in range(200):  # until the engine thread has run the aborts (their blocks are free)
                if not self.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
            return len(remaining)

    # ---- requests ------------------------------------------------------------------------------
    @property
    def is_idle(self) -> bool:
        """No request in flight and none about to be added (readable from any thread)."""
        return not self._streams

    @property
    def num_waiting(self) -> int:
        """Sequences of accepted requests that have produced no output yet (queued or prefilling)."""
        return sum(s.num_seqs for s in self._streams.values() if not s.has_output)

    def check_capacity(self, num_seqs: int = 1) -> None:
        """Raise unless a request of num_seqs sequences (prompts x n) may join the waiting queue:
        EngineDeadError if the engine is gone, 400 if it could never fit, ServerBusyError if full now."""
        if self.fatal_error is not None:
            raise self.fatal_error
        limit = self.max_queued_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise InvalidParameterError(
                f"the request has {num_seqs} sequences (prompts x n); this server queues at most {limit}",
                param="n")
        if self.num_waiting + num_seqs > limit:
            raise ServerBusyError(f"the waiting queue is full ({limit} sequences); retry later")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs as deltas (OutputKind.DELTA): each holds what is new since the
        one before; merge_deltas folds them. A request that fails raises its error here.

        The prompt must already have passed `engine.validate_request`.
        """
        if self.fatal_error is not None:
            raise self.fatal_error
        if request_id in self._streams:
            raise TokenmillError(f"request id {request_id!r} is already in use")
        stream = _Stream(params.n)
        self._streams[request_id] = stream
        self._prompts[request_id] = (prompt_token_ids, prompt_text)
        self._idle.clear()
        try:
            try:
                self._submit(AddCommand(request_id, prompt_token_ids, params, prompt_text, arrival_time or time.time()))
            except BaseException:  # never reached the engine: no output will ever come for it
                self._prompts.pop(request_id, None)
                raise
            while True:
                await stream.ready.wait()
                stream.ready.clear()
                if stream.error is not None:
                    raise stream.error
                output, stream.pending, stream.unread_since = stream.pending, None, None
                # Read before yielding: a failure set while the reader holds this output (a drain's
                # abort) marks the stream finished too, and must be raised, not taken for the end.
                finished = stream.finished
                if output is not None:
                    yield output
                if finished:
                    return
        finally:
            if not stream.finished:
                self.abort(request_id)
            self._forget(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step."""
        self._submit(request_id)

    # ---- event-loop side -----------------------------------------------------------------------
    def _submit(self, command: Command) -> None:
        self.core.submit(command)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    def _fail(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.error, stream.pending = error, None
            stream.finished = True
            stream.ready.set()

    def _fail_all(self, error: BaseException) -> None:
        self._prompts.clear()
        for request_id in list(self._streams):
            self._fail(request_id, error)

    def _deliver(self, result: StepResult) -> None:
        for request_id, error in result.errors.items():
            self._prompts.pop(request_id, None)
            self._fail(request_id, error)
        for output in result.outputs:
            prompt = self._prompts.pop(output.request_id, None) if output.finished else \
                self._prompts.get(output.request_id)
            if prompt is not None and not output.prompt_token_ids:
                output.prompt_token_ids, output.prompt = prompt
        now = time.monotonic()
        for output in result.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.finished:
                continue  # its reader has gone; the abort is already queued
            if output.error is not None:
                self._fail(output.request_id, output.error)
                continue
            stream.pending = output if stream.pending is None else merge_deltas(stream.pending, output)
            stream.unread_since = stream.unread_since or now
            stream.has_output = True
            stream.finished = output.finished
            stream.ready.set()
        for request_id, stream in list(self._streams.items()):
            if stream.unread_since is not None and now - stream.unread_since > self.stall_timeout:
                logger.warning("request %s: its client read nothing for %.0f s; aborting", request_id,
                               self.stall_timeout)
                self._fail(request_id, StreamStalledError(
                    f"the client read nothing for {self.stall_timeout:.0f} s; request aborted"))
                self.abort(request_id)
        if self.step_observer is not None:
            try:
                self.step_observer(result.end_time, result.outputs, result.stats)
            except Exception:  # metrics must never take serving down
                logger.exception("step observer failed")

    # ---- the engine's side ---------------------------------------------------------------------
    def run_engine_loop(self) -> None:
        """Run the core (step the engine, or follow the engine process) until request_stop().
        Blocks: give it a thread.

        If it ends for any other reason (an exception anywhere in the loop, a dead tensor-parallel
        worker, an engine process gone), fatal_error is set, every stream fails at once and new
        requests are refused: the engine never dies silently (`tokenmill serve` then exits with
        status 1).

        Torch ops run measurably (~20%) faster on a process's main thread than on a thread started
        later, so an in-process `tokenmill serve` runs this loop on the main thread and uvicorn on another.
        """
        fatal = self.core.run()
        if fatal is not None:
            self.fatal_error = fatal
            try:
                self._loop.call_soon_threadsafe(self._fail_all, fatal)
            except RuntimeError:  # the event loop is gone already: nobody is waiting
                pass

    def _publish(self, result: StepResult) -> None:
        """Called by the core, on its thread, after every iteration that produced something."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, result)
        except RuntimeError:  # the event loop has closed (the server is exiting): nobody is waiting
            pass
