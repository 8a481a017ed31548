"""`tokenmill serve`: load the model, then run the app under uvicorn with a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from tokenmill.config import DEFAULT_MAX_BODY_BYTES, CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.device_peaks import DevicePeaks, known_peaks, measure_cpu_when_idle
from tokenmill.engine.engine_client import EngineProcessClient
from tokenmill.engine.engine_info import EngineInfo
from tokenmill.engine.metrics import CostModel, UtilizationWindow
from tokenmill.engine.replica_router import PrefixRouter
from tokenmill.engine.replica_set import ReplicaSet, replica_gpus, split_cpus
from tokenmill.engine.structured_output import GrammarCompiler
from tokenmill.errors import TokenmillError
from tokenmill.platform import nvidia_gpu_count, release_free_memory

if TYPE_CHECKING:
    from tokenmill.server.serving_common import ServerContext

logger = logging.getLogger("tokenmill.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
FATAL_EXIT_DELAY_SECONDS = 2.0


@dataclass
class ServeOptions:
    """Everything `tokenmill serve` takes."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    max_queued_requests: int | None = 1024
    drain_timeout: float = 30.0
    stream_stall_timeout: float = 60.0
    dtype: str = "auto"
    device: str = "auto"
    quantization: str | None = None
    seed: int = 0
    log_prompts: bool = False
    ui: bool = True  # the web console at /
    cost_per_hour: float | None = None
    peak_tflops: float | None = None
    peak_bandwidth_gbs: float | None = None
    metrics_window: float = 60.0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # CUDA: no decode graphs
    rendezvous: object | None = None  # set under torchrun (tokenmill.cli)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    chat_template: str | None = None  # a Jinja file that replaces the model's chat template
    tool_call_parser: str | None = None  # default: the format the chat template writes
    reasoning_parser: str | None = None  # qwen3 | deepseek_r1: <think> text -> reasoning_content
    engine_process: bool = True  # the engine in a process of its own (not under torchrun)
    data_parallel_size: int = 1  # engine processes, each on its share of the CPUs
    routing: str = "cache_aware"  # how requests are spread over them: cache_aware | round_robin
    distributed_executor_backend: str = "mp"  # mp: engine processes here; ray: Ray actors on a cluster


def read_chat_template(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise TokenmillError(f"--chat-template: cannot read {path}: {exc.strerror}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM/SIGINT drains instead of closing the listening socket.

    Draining: /ready and new requests answer 503, in-flight requests run to the end (or until the
    drain timeout, then they are aborted), then the server exits with status 0. A second signal
    ends the drain now: what still runs is aborted (its clients get the error) and the server exits
    the same way, not by uvicorn's force-exit, which skipped the app's shutdown and logged a traceback.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, drain_timeout: float) -> None:
        super().__init__(config)
        self.ctx = ctx
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._drain_timeout = float("inf")

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        # Unlike uvicorn's own handler, do not re-raise the signal after shutdown: a drain is a clean exit.
        if self._loop is None or not self.started:  # not serving yet: nothing to drain
            self.ctx.end_streams()
            self.should_exit = True
            return
        if self.should_exit:  # drained already, on the way out
            return
        name = signal.Signals(sig).name
        if self.ctx.draining:
            logger.info("%s again: aborting the requests still running", name)
            self._loop.call_soon_threadsafe(self._start_drain, 0.0)
            return
        self.ctx.draining = True
        logger.info("%s: draining (up to %.0f s), new requests get 503", name, self.drain_timeout)
        self._loop.call_soon_threadsafe(self._start_drain, self.drain_timeout)

    def _start_drain(self, timeout: float) -> None:
        # A second signal can arrive inside the first one's handler (Python runs handlers between any
        # two bytecodes), and then its callback is queued first: a drain only ever gets shorter.
        if self._drain_task is not None:
            if timeout >= self._drain_timeout:
                return
            self._drain_task.cancel()
        self._drain_timeout = timeout
        self._drain_task = asyncio.ensure_future(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        aborted = await self.ctx.engine.drain(timeout)
        if aborted:
            logger.warning("drain ended: aborted %d requests still running", aborted)
        kv = self.ctx.engine.engine.stats().kv_cache  # read from the event loop: a snapshot, good enough
        logger.info("drained; shutting down (KV blocks in use: %d of %d)", kv.num_used_blocks, kv.num_blocks)
        self.ctx.end_streams()
        self.should_exit = True


def serve(options: ServeOptions) -> int:
    """Load the model and serve until a signal drains the server; returns the exit status.

    The engine runs in a process of its own (forked first, before this process has a thread),
    unless options.engine_process is False or torchrun started us (then on this process's main
    thread, uvicorn on another)."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    chat_template = None if options.chat_template is None else read_chat_template(options.chat_template)
    config = _engine_config(options)
    if options.data_parallel_size > 1 or options.distributed_executor_backend == "ray":
        return _serve_replicas(options, config, chat_template)
    if options.engine_process and options.rendezvous is None:
        client = EngineProcessClient.start(config, options.peak_tflops, options.peak_bandwidth_gbs)
        try:
            early = _tokenizer_loaded_meanwhile(config.model, chat_template)
            _import_http_stack()  # meanwhile too
            engine = client.wait_ready(early.for_engine, _grammar_compiler)
            return _serve(options, AsyncLLMEngine(core=client, **_engine_options(options)), engine.info.peaks,
                          engine.info.dtype, chat_template, measure_here=False,
                          kv_cache_dtype=engine.info.kv_cache_dtype,
                          server_tokenizer=early.server_copy_of(engine.tokenizer))
        finally:
            client.shutdown()
    from tokenmill.engine.engine_core import LLMEngine  # torch: only a process that runs the engine loads it

    engine = LLMEngine(config)
    try:
        peaks = known_peaks(engine.device, options.peak_tflops, options.peak_bandwidth_gbs)
        return _serve(options, AsyncLLMEngine(engine, **_engine_options(options)), peaks,
                      str(engine.dtype).removeprefix("torch."), chat_template, measure_here=engine.device.type == "cpu",
                      kv_cache_dtype=str(engine.kv_cache_dtype).removeprefix("torch."))
    finally:
        engine.shutdown()


def _serve_replicas(options: ServeOptions, config: EngineConfig, chat_template: str | None) -> int:
    """--data-parallel-size N: N engine processes, each on its own share of this machine's CPUs
    (and, on CUDA, a GPU of its own), or, with
    --distributed-executor-backend ray, N Ray actors spread over a cluster's nodes; one
    prefix-hash key for all of them and the router."""
    ray = options.distributed_executor_backend == "ray"
    if options.rendezvous is not None or not options.engine_process or (options.tensor_parallel_size > 1 and not ray):
        raise TokenmillError("replicas need engine processes: not under torchrun or with --no-engine-process, and "
                             "--tensor-parallel-size only with --distributed-executor-backend ray")
    config.cache.prefix_hash_key = secrets.token_bytes(16)  # this deployment's: replicas and router agree
    placement = None
    if ray:
        from tokenmill.engine.ray_replicas import RayPlacement

        placement = RayPlacement(options.data_parallel_size, options.tensor_parallel_size)

        def fork_replica(index: int) -> EngineProcessClient:
            return placement.start(index, config)
    else:
        try:
            shares = split_cpus(options.data_parallel_size)
            gpus = replica_gpus(options.data_parallel_size, options.device, nvidia_gpu_count())
        except ValueError as exc:
            raise TokenmillError(f"--data-parallel-size: {exc}") from None

        def fork_replica(index: int) -> EngineProcessClient:
            return EngineProcessClient.start(config, options.peak_tflops, options.peak_bandwidth_gbs,
                                             measure_peaks=False, cpu_cores=shares[index], gpu=gpus[index])

    clients: list[EngineProcessClient] = []
    replicas: ReplicaSet | None = None
    try:
        for index in range(options.data_parallel_size):  # all started before this process starts a thread
            clients.append(fork_replica(index))
        first = clients[0].wait_ready(_load_tokenizer, _grammar_compiler)

        def wait_replica(client: EngineProcessClient) -> None:
            client.wait_ready(lambda info: first.tokenizer, lambda tokenizer, info: first.grammars)

        for client in clients[1:]:
            wait_replica(client)
        router = PrefixRouter([c.engine.info.limits.num_kv_blocks for c in clients], first.info.limits.block_size,
                              config.cache.prefix_hash_key, options.routing)
        replicas = ReplicaSet(clients, router, fork_replica, wait_replica)
        return _serve(options, AsyncLLMEngine(core=replicas, **_engine_options(options)), first.info.peaks,
                      first.info.dtype, chat_template, measure_here=False, replicas=replicas,
                      kv_cache_dtype=first.info.kv_cache_dtype)
    finally:
        if replicas is not None:
            replicas.shutdown()
        for client in clients:
            client.shutdown()
        if placement is not None:
            placement.shutdown()


def _engine_config(options: ServeOptions) -> EngineConfig:
    return EngineConfig(
        model=options.model,
        dtype=options.dtype,
        device=options.device,
        quantization=options.quantization,
        seed=options.seed,
        tensor_parallel_size=options.tensor_parallel_size,
        enforce_eager=options.enforce_eager,
        rendezvous=options.rendezvous,
        cache=CacheConfig(kv_cache_memory=options.kv_cache_memory, kv_cache_dtype=options.kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=options.max_model_len,
        ),
    )


def _engine_options(options: ServeOptions) -> dict:
    return {"max_queued_requests": options.max_queued_requests, "stall_timeout": options.stream_stall_timeout}


def _load_tokenizer(info: EngineInfo):
    from tokenmill.models.model_files import load_tokenizer

    return load_tokenizer(Path(info.model_path))


@dataclass
class EarlyTokenizer:
    """A GGUF's cached tokenizer, and the server's own copy of it (ServerContext's, for its tokenizer
    thread), both made while the engine process loads the model; None where that could not be."""

    path: Path | None = None
    tokenizer: object | None = None
    server_copy: object | None = None

    def for_engine(self, info: EngineInfo) -> object:
        """The tokenizer of the model the engine loaded (wait_ready's load_tokenizer)."""
        return self.tokenizer if self.tokenizer is not None and Path(info.model_path) == self.path \
            else _load_tokenizer(info)

    def server_copy_of(self, tokenizer: object) -> object | None:
        return self.server_copy if tokenizer is self.tokenizer else None


def _tokenizer_loaded_meanwhile(model: str | None, chat_template: str | None = None) -> EarlyTokenizer:
    """Load a GGUF's cached tokenizer (with the --chat-template given), and copy it, now, while the
    engine process loads the model (~1 s of start-up each; the copy ~0.2 s, which ServerContext made
    once the engine was ready). Anything else waits for the engine: a model that cannot be found or
    read (the engine reports why), and a first conversion (the engine's caches it; converting here
    would import torch)."""
    from tokenmill.models.model_files import cached_tokenizer, resolve_model_path

    try:
        path = resolve_model_path(model)
    except TokenmillError:
        return EarlyTokenizer()
    early = cached_tokenizer(path)
    if early is None:
        return EarlyTokenizer()
    if chat_template is not None:
        early.chat_template = chat_template
    return EarlyTokenizer(path, early, copy.deepcopy(early))


def _grammar_compiler(tokenizer, info: EngineInfo) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, info.model_config.vocab_size, info.model_config.eos_token_ids)


def _import_http_stack():
    """The HTTP stack's modules (fastapi, pydantic: ~0.35 s of imports), imported only after the
    engine process was forked, and while it loads the model, so that the two start-ups overlap."""
    import pydantic.v1  # noqa: F401  (fastapi imports it as it builds the routes, to spot v1 models: ~40 ms)

    from tokenmill.server.app import build_app
    from tokenmill.server.metrics import ServingMetrics
    from tokenmill.server.reasoning import REASONING_PARSERS
    from tokenmill.server.serving_common import ServerContext

    return build_app, ServingMetrics, REASONING_PARSERS, ServerContext


def _serve(options: ServeOptions, async_engine: AsyncLLMEngine, peaks: DevicePeaks, dtype: str,
           chat_template: str | None, measure_here: bool, replicas: ReplicaSet | None = None,
           kv_cache_dtype: str = "", server_tokenizer: object | None = None) -> int:
    """Serve an engine (here or in its process) until a drain or its death; returns the exit status.

    peaks: the device's, known so far (an engine process fills them in when it has measured the
    CPU; measure_here: measure it from this process, while the engine is idle). server_tokenizer:
    the server's own copy of the engine's tokenizer, if one was made ahead."""
    build_app, ServingMetrics, REASONING_PARSERS, ServerContext = _import_http_stack()

    engine = async_engine.engine
    # A name, never a path, is what /v1/models shows; the --model argument as given is accepted too.
    model_name = options.served_model_name or (Path(options.model).name if options.model else DEFAULT_MODEL_NAME)
    # FLOPs and bytes per step of the loaded model against the device's peaks: given, else from the
    # catalog (known GPUs) or this CPU's cached measurement; unknown peaks leave MFU/MBU undefined.
    cost_model = CostModel.for_model(engine.model_config, dtype, peaks, options.cost_per_hour,
                                     options.max_num_batched_tokens, kv_cache_dtype or None)
    metrics = ServingMetrics(model_name, UtilizationWindow(cost_model, options.metrics_window),
                             log_prompts=options.log_prompts)
    async_engine.step_observer = metrics.observe_step
    if replicas is not None:
        metrics.replica_source = replicas.statuses
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template
    ctx = ServerContext(async_engine, model_name, metrics, log_prompts=options.log_prompts,
                        own_tokenizer=server_tokenizer,
                        model_aliases=frozenset({options.model} if options.model else ()),
                        tool_call_parser=options.tool_call_parser,
                        reasoning_parser=None if options.reasoning_parser is None
                        else REASONING_PARSERS[options.reasoning_parser])
    app = build_app(ctx, api_key=options.api_key, max_body_bytes=options.max_body_bytes, engine_thread=False,
                    ui=options.ui)
    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_config=None, access_log=False,
        log_level=options.log_level, timeout_graceful_shutdown=5, lifespan="on",
    )
    server = DrainingServer(config, ctx, options.drain_timeout)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    release_free_memory()  # what loading the tokenizer and the HTTP stack freed (~25 MB stay resident otherwise)
    # uvicorn on a second thread, the engine loop (or the engine process's results) on this main thread
    http_thread = threading.Thread(target=_run_http, args=(server, async_engine), name="tokenmill-http")
    logger.info("serving %s on http://%s:%d/v1%s", model_name, options.host, options.port,
                f" (console: http://{options.host}:{options.port}/)" if options.ui else "")
    http_thread.start()
    while not async_engine.wait_attached(timeout=0.2):
        if not http_thread.is_alive():  # uvicorn could not start (port in use, ...)
            return 1
    probe = None
    try:
        if measure_here:  # refine (or find) this CPU's peaks while nothing is being served
            probe = measure_cpu_when_idle(cost_model.peaks, lambda: async_engine.is_idle, options.peak_tflops,
                                          options.peak_bandwidth_gbs)
        async_engine.run_engine_loop()  # returns on shutdown, or when the engine died (fatal_error)
        if async_engine.fatal_error is not None:
            logger.error("shutting down: %s", async_engine.fatal_error.message)
            # a moment for in-flight streams to send their error and for health checks to see 503s
            time.sleep(FATAL_EXIT_DELAY_SECONDS)
            ctx.end_streams()
            server.should_exit = True  # then exit 1, for the supervisor to restart us
        http_thread.join()
    finally:
        if probe is not None:
            probe.stop()
    if async_engine.fatal_error is not None:
        return 1
    return 0 if server.started else 1


def _run_http(server: DrainingServer, async_engine: AsyncLLMEngine) -> None:
    try:
        server.run()
    finally:
        async_engine.request_stop()
