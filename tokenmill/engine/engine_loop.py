"""EngineLoop: the engine's side of serving — commands in, one StepResult out per iteration.

It is the same loop whether it runs on a thread of the server's process (AsyncLLMEngine's
in-process core) or as the main loop of an engine process (engine_process.py): commands arrive
through submit() from any thread, results leave through the `publish` callback, on the loop's
own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.engine_info import EngineStats
from tokenmill.errors import EngineDeadError
from tokenmill.outputs import OutputKind, RequestOutput
from tokenmill.platform import release_free_memory
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

TRIM_INTERVAL = 10.0  # seconds between two returns of freed heap memory to the system


@dataclass
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_text: str | None
    arrival_time: float


# A command is an AddCommand, or a str: the id of a request to abort.
Command = AddCommand | str


@dataclass
class StepResult:
    """What one iteration produced: outputs (deltas), the engine's figures after it, and the
    requests whose add failed (request id -> error)."""

    end_time: float
    outputs: list[RequestOutput]
    stats: EngineStats
    errors: dict[str, BaseException]


def without_prompts(result: StepResult) -> StepResult:
    """The result with each output's prompt (text and token ids) left out: what goes over a wire,
    whose reader sent those prompts itself and puts them back (AsyncLLMEngine._deliver). Without
    this every step would carry every running request's whole prompt again."""
    for output in result.outputs:
        output.prompt, output.prompt_token_ids = None, []
    return result


class EngineLoop:
    """Step an LLMEngine whenever it has work; run() blocks until request_stop() or a fatal error."""

    def __init__(self, engine, publish: Callable[[StepResult], None]) -> None:
        self.engine = engine  # an LLMEngine (typed loosely: this module is imported where torch is not)
        self.publish = publish
        self._commands: list[Command] = []
        self._wakeup = threading.Condition()
        self._stopping = False
        self.fatal_error: EngineDeadError | None = None  # set when the loop stopped for good

    @property
    def is_idle(self) -> bool:
        """Nothing queued and nothing running (readable from any thread)."""
        return not self._commands and not self.engine.has_unfinished_requests()

    def submit(self, command: Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def request_stop(self) -> None:
        """Make run() return after it has run the commands already queued (thread-safe)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()

    def run(self, still_wanted: Callable[[], bool] = lambda: True) -> EngineDeadError | None:
        """Loop until request_stop() (returns None) or until the engine cannot go on (returns, and
        keeps in fatal_error, the EngineDeadError). still_wanted() is asked about once a second
        while idle; False stops the loop as request_stop() would (an engine whose server is gone)."""
        try:
            self._loop_until_stopped(still_wanted)
        except Exception as exc:
            logger.exception("the engine loop failed")
            self.fatal_error = EngineDeadError(f"the engine stopped after an internal error ({type(exc).__name__})")
        return self.fatal_error

    def _loop_until_stopped(self, still_wanted: Callable[[], bool]) -> None:
        engine = self.engine
        next_trim = time.monotonic() + TRIM_INTERVAL
        while True:
            if time.monotonic() >= next_trim:  # keep RSS flat under traffic of ever-changing shapes
                release_free_memory()
                next_trim = time.monotonic() + TRIM_INTERVAL
            with self._wakeup:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._wakeup.wait(timeout=1.0)  # a timeout keeps the main thread responsive to signals
                    if self._commands or self._stopping:
                        break
                    if self._dead():
                        return
                    if not still_wanted():
                        self._stopping = True
                commands, self._commands = self._commands, []
                stopping = self._stopping
            outputs, errors = self._apply(commands)
            if stopping:  # the aborts queued before the stop have run: nothing holds KV blocks
                return
            if engine.has_unfinished_requests():
                try:
                    outputs += engine.step()  # a request that fails a step comes back with its error
                except EngineDeadError as exc:
                    logger.error("engine is dead: %s", exc.message)
                    self.fatal_error = exc
                    return
            if outputs or errors or commands:
                self.publish(StepResult(time.time(), outputs, engine.stats(), errors))

    def _dead(self) -> bool:
        try:
            self.engine.check_health()
        except EngineDeadError as exc:
            logger.error("engine is dead: %s", exc.message)
            self.fatal_error = exc
            return True
        return False

    def _apply(self, commands: list[Command]) -> tuple[list[RequestOutput], dict[str, BaseException]]:
        """Run queued adds and aborts; returns the final outputs of aborted requests, and add errors."""
        aborted: list[RequestOutput] = []
        errors: dict[str, BaseException] = {}
        for command in commands:
            if isinstance(command, str):
                output = self.engine.abort_request(command)
                if output is not None:
                    aborted.append(output)
                continue
            try:
                self.engine.add_request(
                    command.request_id, command.prompt_token_ids, command.params,
                    arrival_time=command.arrival_time, prompt_text=command.prompt_text,
                    output_kind=OutputKind.DELTA,
                )
            except Exception as exc:
                errors[command.request_id] = exc
        return aborted, errors
