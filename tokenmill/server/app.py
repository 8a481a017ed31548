"""The FastAPI app: routes of the OpenAI-compatible API plus health, metrics and tokenizer endpoints."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.config import DEFAULT_MAX_BODY_BYTES
from tokenmill.engine.replica_set import ReplicaSet
from tokenmill.errors import InvalidParameterError, ModelNotFoundError, TokenmillError
from tokenmill.server.errors import error_response, invalid_body
from tokenmill.server.metrics import replica_row
from tokenmill.server.middleware import AccessLogMiddleware, ApiKeyMiddleware, BodySizeLimitMiddleware
from tokenmill.server.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, refuse_unsupported_fields,
    to_conversation,
)
from tokenmill.server.serving_chat import create_chat_completion, render_chat_completion
from tokenmill.server.serving_common import ClientDisconnected, ResponseLog, ServerContext, now_seconds
from tokenmill.server.serving_completion import create_completion, render_completion
from tokenmill.server.stats_feed import StatsFeed
from tokenmill.server.ui import add_ui_routes
from tokenmill.version import __version__

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it

Handler = Callable[[ServerContext, BaseModel, Callable, ResponseLog], Awaitable[Response]]
# The routes read their bodies themselves (for OpenAI-shaped errors); the schema still describes them.
BODY_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/v1/completions/render": CompletionRequest, "/v1/chat/completions/render": ChatCompletionRequest,
}


LARGE_BODY_BYTES = 1 << 20  # bodies above this are parsed on a worker thread


async def read_json_object(request: Request) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it: not JSON, not an
    object, nested too deeply, or holding text that is not valid Unicode (a lone surrogate escape)."""
    raw = await request.body()
    body = await asyncio.to_thread(_parse_json, raw) if len(raw) > LARGE_BODY_BYTES else _parse_json(raw)
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    if b"\\ud" in raw.lower():  # an escaped surrogate: valid only as a high + low pair
        _check_unicode(body)
    return body


def _parse_json(raw: bytes):
    def reject_constant(name: str) -> float:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(raw, parse_constant=reject_constant)
    except RecursionError:
        raise InvalidParameterError("the request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"the request body is not valid JSON: {exc}") from exc


def _check_unicode(value) -> None:
    """400 if any string (key or value) cannot be encoded as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidParameterError("the request body holds text that is not valid Unicode "
                                            "(an unpaired surrogate)") from None


def build_app(ctx: ServerContext, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              engine_thread: bool = True, ui: bool = True, stats_interval: float = 1.0) -> FastAPI:
    """The ASGI app around one AsyncLLMEngine, attached and stopped with the app's lifespan.

    engine_thread: start the engine loop on a new thread; False when the caller runs
    `ctx.engine.run_engine_loop()` on a thread of its own (the launcher uses the main thread).
    ui: serve the web console at / (its feed, /v1/stats/stream, is there either way).
    """
    feed = ctx.stats_feed = StatsFeed(ctx.metrics, server_facts(ctx, ui), stats_interval)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine_thread:
            ctx.engine.start()
        else:
            ctx.engine.attach()
        ctx.metrics.observe_engine(ctx.engine.engine.stats())  # figures before the first step
        ticker = asyncio.create_task(feed.run())
        try:
            yield
        finally:
            feed.close()
            ticker.cancel()
            with suppress(asyncio.CancelledError):
                await ticker
            await ctx.engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        error = TokenmillError(str(exc.detail))
        error.http_status, error.error_type = exc.status_code, "invalid_request_error"
        if exc.status_code == 404:
            error.error_type = "not_found_error"
        return error_response(error)

    async def run(request: Request, body_type: type[BaseModel], handler: Handler) -> Response:
        log: ResponseLog = request.state.log
        try:
            data = await read_json_object(request)
            refuse_unsupported_fields(data, getattr(body_type, "unsupported_fields", {}))
            try:
                body = body_type.model_validate(data)
            except ValidationError as exc:
                raise invalid_body(exc) from None
            if ctx.log_prompts:
                log.extra["body"] = json.dumps(body.model_dump(exclude_none=True))
            return await handler(ctx, body, request.receive, log)
        except TokenmillError as exc:
            if exc.http_status >= 500 and exc.http_status != 503:
                logger.error("request failed: %s", exc.message)
            elif exc.http_status != 503:  # 503s were counted where they were decided
                ctx.metrics.observe_rejection(exc.error_type)
            return error_response(exc)
        except ClientDisconnected:
            log.extra["aborted"] = "client_disconnected"
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:  # one broken request is a 500 for that request, nothing more
            logger.exception("internal error while serving a request")
            return error_response(TokenmillError("internal server error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/completions/render")
    async def completions_render(request: Request) -> Response:
        return await run(request, CompletionRequest, render_completion)

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(request: Request) -> Response:
        return await run(request, ChatCompletionRequest, render_chat_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await run(request, TokenizeRequest, _tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await run(request, DetokenizeRequest, _detokenize)

    def model_card() -> dict:
        return {"id": ctx.model_name, "object": "model", "created": now_seconds(), "owned_by": "tokenmill",
                "root": ctx.model_name, "max_model_len": ctx.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            ctx.check_model(model_id)
        except TokenmillError as exc:
            return error_response(exc)
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        """The process is up and its engine alive (a dead engine is a restart, not a wait)."""
        if ctx.engine.fatal_error is not None:
            return error_response(ctx.engine.fatal_error)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        if ctx.engine.fatal_error is not None:
            return JSONResponse({"status": "dead"}, status_code=503)
        if ctx.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/stats")
    async def stats() -> Response:
        return JSONResponse(feed.snapshot())

    def replica_set() -> ReplicaSet:
        if not isinstance(ctx.engine.core, ReplicaSet):
            raise ModelNotFoundError("this server runs one engine, not replicas")
        return ctx.engine.core

    @app.get("/v1/replicas")
    async def replicas() -> Response:
        """The data-parallel replicas (--data-parallel-size), each up or down, with its figures."""
        try:
            return JSONResponse({"data": [replica_row(status) for status in replica_set().statuses()]})
        except TokenmillError as exc:
            return error_response(exc)

    @app.post("/v1/replicas/{index}/restart")
    async def restart_replica(index: int) -> Response:
        """Start a replica that is down again (its new engine process loads the model first)."""
        try:
            return JSONResponse(replica_row(await asyncio.to_thread(replica_set().restart, index)))
        except TokenmillError as exc:
            return error_response(exc)

    @app.get("/v1/stats/stream")
    async def stats_stream() -> Response:
        """Server-sent events: the figures of /v1/stats once per tick, the first with the history."""
        return StreamingResponse(feed.events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    if ui:
        add_ui_routes(app)

    app.openapi = lambda: _openapi_with_bodies(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_ui=ui)
    app.add_middleware(AccessLogMiddleware)  # added last = outermost: it sees 401s and 413s too
    return app


def server_facts(ctx: ServerContext, ui: bool) -> dict:
    """What the console shows of the model and the engine: fixed for the server's life."""
    engine = ctx.engine.engine
    cost = ctx.metrics.window.cost_model if ctx.metrics.window is not None else None
    return {"model_name": ctx.model_name, "version": __version__, **asdict(engine.facts()),
            "cost_per_hour": cost.cost_per_hour if cost is not None else None, "log_prompts": ctx.log_prompts, "ui": ui}


def _openapi_with_bodies(app: FastAPI) -> dict:
    """FastAPI's schema of the routes, with the request body of each POST route from its pydantic model."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in BODY_MODELS.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            }
        app.openapi_schema = schema
    return app.openapi_schema


async def _tokenize(ctx: ServerContext, body: TokenizeRequest, receive, log: ResponseLog) -> Response:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidParameterError("give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        conversation = to_conversation(body.messages)
        ctx.check_text_length(sum(len(m["content"]) for m in conversation), "messages")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt, tokens = await ctx.off_loop(
            lambda: ctx.inputs.tokenize_chat(conversation, body.add_generation_prompt, tools,
                                             continue_final_message=body.continue_final_message,
                                             template_kwargs=body.chat_template_kwargs))
        if body.return_prompt:
            return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len,
                                 "prompt": prompt})
    else:
        ctx.check_text_length(len(body.prompt), "prompt")
        tokens = await ctx.off_loop(ctx.inputs.tokenize, body.prompt, body.add_special_tokens)
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})


async def _detokenize(ctx: ServerContext, body: DetokenizeRequest, receive, log: ResponseLog) -> Response:
    ctx.check_model(body.model)
    if len(body.tokens) > ctx.max_model_len:
        raise InvalidParameterError(
            f"{len(body.tokens)} tokens are more than the context holds ({ctx.max_model_len})", param="tokens")
    if any(t >= ctx.vocab_size for t in body.tokens):
        raise InvalidParameterError(f"token ids must be in [0, {ctx.vocab_size})", param="tokens")
    return JSONResponse({"prompt": await ctx.off_loop(ctx.inputs.decode, body.tokens)})
