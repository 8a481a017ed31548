"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from tokenmill.errors import InvalidParameterError, TokenmillError

RETRY_AFTER_SECONDS = 1


def error_body(exc: TokenmillError) -> dict:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.http_status}}


def error_response(exc: TokenmillError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if exc.http_status == 503 else None
    return JSONResponse(error_body(exc), status_code=exc.http_status, headers=headers)


def invalid_body(exc: ValidationError) -> InvalidParameterError:
    """The first problem pydantic found, as a 400 naming the field."""
    first = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in first["loc"]) or None
    return InvalidParameterError(f"{param}: {first['msg']}" if param else first["msg"], param=param)
