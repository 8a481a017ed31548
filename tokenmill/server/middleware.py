"""Pure ASGI middleware (cheap on streamed responses): API key, body size limit, access log."""

from __future__ import annotations

import hmac
import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.errors import AuthenticationError, RequestBodyTooLargeError, TokenmillError
from tokenmill.server.errors import error_body
from tokenmill.server.serving_common import ResponseLog
from tokenmill.server.ui import is_ui_path

access_logger = logging.getLogger("tokenmill.access")

UNAUTHENTICATED_PATHS = frozenset({"/health"})


async def _send_error(send: Send, exc: TokenmillError) -> None:
    body = json.dumps(error_body(exc)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.http_status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every route but /health (and the console's own files, which hold no data) needs
    `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app: ASGIApp, api_key: str, public_ui: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.public_ui = public_ui

    def _is_public(self, path: str) -> bool:
        return path in UNAUTHENTICATED_PATHS or (self.public_ui and is_ui_path(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._is_public(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _send_error(send, AuthenticationError("missing or invalid API key"))
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a body over the limit: by Content-Length up front, or while a chunked body arrives."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = RequestBodyTooLargeError(f"the request body is over the limit of {self.max_body_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, too_large)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise too_large  # the route turns it into the 413 response
            return message

        await self.app(scope, limited_receive, send)


class AccessLogMiddleware:
    """One line per request when its response is complete: id, status, token counts, timings."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.time()
        log = ResponseLog()
        given_id = _sanitized_request_id(dict(scope["headers"]).get(b"x-request-id", b""))
        if given_id:
            log.request_id = given_id  # the engine keeps its own unique key: clients may repeat ids
        else:
            log.engine_id = log.request_id  # one id for response, log line and console: both unique
        scope.setdefault("state", {})["log"] = log
        status = 0

        async def logging_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", log.request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            _log_line(scope, status or 500, log, start)


MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.:")


def _sanitized_request_id(raw: bytes) -> str:
    """A client's X-Request-Id with only letters, digits and -_.: kept, at most 128 of them."""
    return bytes(c for c in raw[: 4 * MAX_REQUEST_ID_CHARS] if c in _REQUEST_ID_CHARS)[:MAX_REQUEST_ID_CHARS].decode()


def _escaped(text: str) -> str:
    """Text for one log line: control and non-ASCII characters as escapes, so nothing can forge a line."""
    return "".join(c if " " <= c < "\x7f" else c.encode("unicode_escape").decode("ascii") for c in text)


def _log_line(scope: Scope, status: int, log: ResponseLog, start: float) -> None:
    now = time.time()
    client = scope.get("client")
    parts = [
        f"{client[0] if client else '-'} {_escaped(scope['method'])} {_escaped(scope['path'])} {status}",
        f"request_id={log.request_id}",
    ]
    if log.is_generation:
        ttft = f"{log.first_token_time - start:.3f}s" if log.first_token_time else "-"
        parts.append(f"prompt_tokens={log.prompt_tokens} completion_tokens={log.completion_tokens} ttft={ttft}")
    parts.append(f"duration={now - start:.3f}s")
    parts.extend(f"{key}={_escaped(str(value))}" for key, value in log.extra.items())
    access_logger.info(" ".join(parts))
