"""Typed errors. Each user-facing error carries the HTTP status and OpenAI error type
the server will answer with, so every layer raises the same thing."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class of every error tokenmill raises on purpose."""

    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidParameterError(TokenmillError, ValueError):
    """A sampling or request parameter is out of its allowed range."""

    http_status = 400
    error_type = "invalid_request_error"


class RequestTooLongError(InvalidParameterError):
    """Prompt plus max_tokens can never fit (max_model_len or the KV pool)."""


class ModelLoadError(TokenmillError):
    """A model could not be found, parsed or is of an unsupported kind."""

    http_status = 500
    error_type = "model_load_error"


class DefaultModelMissingError(ModelLoadError):
    """The default model package is not installed."""


class ServerBusyError(TokenmillError):
    """The server cannot take the request now (queue full or draining); retry later."""

    http_status = 503
    error_type = "server_busy"


class ModelNotFoundError(TokenmillError):
    """The request names a model this server does not serve."""

    http_status = 404
    error_type = "not_found_error"


class AuthenticationError(TokenmillError):
    """Missing or wrong API key."""

    http_status = 401
    error_type = "authentication_error"


class RequestBodyTooLargeError(TokenmillError):
    """The request body is over the server's size limit."""

    http_status = 413
    error_type = "invalid_request_error"


class EngineDeadError(TokenmillError):
    """The engine cannot go on (its loop failed, a tensor-parallel worker died); the server exits."""

    http_status = 503
    error_type = "engine_dead"


class StreamStalledError(TokenmillError):
    """The client stopped reading its stream; the request was aborted to bound what waits for it."""

    http_status = 408
    error_type = "stream_stalled"
