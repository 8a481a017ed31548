"""What both generation endpoints share: admission checks, tokenizing, running streams, SSE, usage."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import InitVar, dataclass, field

from starlette.responses import StreamingResponse
from starlette.types import Receive

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.errors import InvalidParameterError, ModelNotFoundError, ServerBusyError, TokenmillError
from tokenmill.outputs import Logprob, PromptLogprobs, RequestOutput, merge_deltas
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import error_body
from tokenmill.server.metrics import ServingMetrics
from tokenmill.server.reasoning import ReasoningParser
from tokenmill.server.stats_feed import StatsFeed
from tokenmill.server.tool_calls import ToolParser, choose_tool_parser

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
# Tokens one request may ask the engine for, prompts and outputs of all its sequences, in units of
# max_model_len: 16 full-context sequences (n = 16 of one long chat, or many short prompts).
MAX_REQUEST_TOKENS_IN_CONTEXTS = 16


@dataclass
class ServerContext:
    """Everything a route handler needs; one per server."""

    engine: AsyncLLMEngine
    model_name: str
    metrics: ServingMetrics
    log_prompts: bool = False
    draining: bool = False
    model_aliases: frozenset[str] = frozenset()  # other names clients may use (the --model argument)
    tool_call_parser: str | None = None  # --tool-call-parser; default: the chat template's format
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    stats_feed: StatsFeed | None = None  # the console's feed, set by build_app
    own_tokenizer: InitVar[object | None] = None  # `inputs`' tokenizer if made ahead; else a copy of the engine's
    # The server's own tokenizer copy, used only on one worker thread (off_loop): HF fast tokenizers
    # are not safe to share across threads, and a large prompt must not stall the event loop.
    inputs: InputProcessor = field(init=False)
    tool_parser: ToolParser | None = field(init=False)
    _tokenizer_thread: ThreadPoolExecutor = field(init=False)
    _grammar_thread: ThreadPoolExecutor = field(init=False)
    _max_token_chars: Future[int] = field(init=False)

    def __post_init__(self, own_tokenizer: object | None) -> None:
        tokenizer = copy.deepcopy(self.engine.engine.tokenizer) if own_tokenizer is None else own_tokenizer
        self.inputs = InputProcessor(tokenizer)
        self.tool_parser = choose_tool_parser(self.inputs.tokenizer.chat_template, self.tool_call_parser)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")
        self._grammar_thread = ThreadPoolExecutor(2, thread_name_prefix="tokenmill-grammar")
        # a pass over the vocabulary (~50-100 ms for 49k tokens): at start, on the tokenizer's own
        # thread, rather than in the first request's time to first token
        self._max_token_chars = self._tokenizer_thread.submit(lambda: self.inputs.max_token_chars)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured-output constraint off the event loop and the engine loop
        (the engine then finds it in its cache); InvalidParameterError (400) if it is bad."""
        if params.structured_outputs is not None:
            await asyncio.get_running_loop().run_in_executor(
                self._grammar_thread, self.engine.engine.grammars.compile, params.structured_outputs)

    async def off_loop(self, fn: Callable, *args):
        """fn(*args) on the tokenizer thread: tokenizing, chat templates, detokenizing."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that could never fit the context."""
        per_token = self._max_token_chars.result()  # waits only for a request in the first ~0.1 s
        if num_chars > self.max_model_len * per_token:
            raise InvalidParameterError(
                f"the {param} has {num_chars} characters; no text over {self.max_model_len * per_token} characters "
                f"(max_model_len {self.max_model_len} x {per_token} per token) can fit", param=param)

    def check_request_tokens(self, num_tokens: int) -> None:
        limit = MAX_REQUEST_TOKENS_IN_CONTEXTS * self.max_model_len
        if num_tokens > limit:
            raise InvalidParameterError(
                f"the request asks for {num_tokens} tokens (prompt + max_tokens, times n, over its prompts); "
                f"at most {limit} per request", param="max_tokens")

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model_config.vocab_size

    def end_streams(self) -> None:
        """The server is about to exit: end the streams that never end by themselves (the feed's)."""
        if self.stats_feed is not None:
            self.stats_feed.close()

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name and name not in self.model_aliases:
            shown = name if len(name) <= 64 else name[:64] + "..."
            raise ModelNotFoundError(f"the model {shown!r} does not exist; this server serves {self.model_name!r}",
                                     param="model")

    def check_accepting(self, num_seqs: int) -> None:
        """503 while draining, when the engine is dead or the waiting queue has no room for
        num_seqs more sequences; 400 for a request that could never fit the queue."""
        try:
            if self.draining:
                raise ServerBusyError("the server is shutting down")
            self.engine.check_capacity(num_seqs)
        except ServerBusyError:
            self.metrics.observe_rejection("draining" if self.draining else "queue_full")
            raise

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check one prompt against the limits; returns its effective max_tokens."""
        return self.engine.engine.validate_request(prompt_token_ids, params)


@dataclass
class ResponseLog:
    """What the access log line reports of a request (never its text unless --log-prompts)."""

    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # the client's X-Request-Id if it sent one
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # always unique: the engine's key
    is_generation: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token_time: float | None = None
    extra: dict = field(default_factory=dict)


def now_seconds() -> int:
    return int(time.time())


_SSE_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))  # json.dumps would build one per event


def sse(payload: dict) -> str:
    return f"data: {_SSE_JSON.encode(payload)}\n\n"


def sse_response(chunks: AsyncIterator[dict], log: ResponseLog) -> StreamingResponse:
    """Server-sent events of `chunks`, then [DONE]; a failure after the 200 becomes an error event."""

    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except Exception as exc:  # headers are sent: the error goes in the stream
            yield stream_error(exc, log)
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")


def stream_error(exc: Exception, log: ResponseLog) -> str:
    """The event that ends a stream that failed after its 200 was sent."""
    if not isinstance(exc, TokenmillError):
        logger.error("request %s failed mid-stream", log.request_id, exc_info=exc)
        exc = TokenmillError("internal server error")
    log.extra["error"] = exc.http_status
    return sse(error_body(exc))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def prompt_logprobs_json(entries: PromptLogprobs) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, then token id -> logprob, rank, decoded token."""
    return [None if entry is None else
            {str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for token_id, lp in entry.items()} for entry in entries]


def top_entries(entry: dict[int, Logprob], limit: int) -> list[tuple[int, Logprob]]:
    """The `limit` most likely tokens of one position, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
    return ranked[:limit]


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: (stream index, output)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, done))
        except BaseException as exc:
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def run_unless_disconnected(work: Awaitable, receive: Receive):
    """Await `work`, cancelling it (which aborts its requests) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.create_task(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        raise ClientDisconnected()
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        await asyncio.gather(work_task, watch_task, return_exceptions=True)


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body has been read already, so the next message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run requests to the end; each one's deltas folded into its whole output, in stream order."""
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for index, output in merge_streams(streams):
        finals[index] = output if finals[index] is None else merge_deltas(finals[index], output)
    return finals  # type: ignore[return-value]


@dataclass
class ChoiceUpdate:
    """What one choice gained from one engine output: text, token ids (and their logprobs), finish."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None  # of the choice's prompt, once the engine scored it
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it


@dataclass
class ChoiceTracker:
    """Turns the delta outputs of k prompts x n samples into per-choice updates (choice = prompt * n + sample)."""

    n: int
    num_tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # by prompt index

    def updates(self, prompt_index: int, output: RequestOutput) -> list[ChoiceUpdate]:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        result = []
        for sample in output.outputs:
            index = prompt_index * self.n + sample.index
            if index in self.finished:
                continue
            self.num_tokens[index] = self.num_tokens.get(index, 0) + len(sample.token_ids)
            if sample.finish_reason is not None:
                self.finished.add(index)
            elif not sample.text and not sample.token_ids:
                continue
            result.append(ChoiceUpdate(index, sample.text, sample.token_ids, sample.logprobs, sample.finish_reason,
                                       self.prompt_logprobs.get(prompt_index), sample.stop_reason))
        return result

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.num_tokens.values())


async def stream_updates(
    streams: list[AsyncIterator[RequestOutput]], tracker: ChoiceTracker, log: ResponseLog
) -> AsyncIterator[list[ChoiceUpdate]]:
    """The choice updates of each engine output, as they come."""
    async for prompt_index, output in merge_streams(streams):
        updates = tracker.updates(prompt_index, output)
        if updates:
            if log.first_token_time is None:
                log.first_token_time = time.time()
            log.completion_tokens = tracker.num_completion_tokens
            yield updates
