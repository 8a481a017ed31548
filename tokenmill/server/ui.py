"""The web console's files: `/` is the page, `/ui/...` its scripts, styles and the vendored chart
library, all read from the package (no build step, no CDN) and sent with a restrictive
Content-Security-Policy. The page holds no data: what it shows comes from the API, with the key."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response

from tokenmill.errors import TokenmillError
from tokenmill.server.errors import error_response

STATIC_DIR = Path(__file__).parent / "static"
UI_PREFIX = "/ui/"
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Scripts and styles from this origin only (no inline script, no eval), API calls to this origin,
# no frames, forms, plugins or base-URI tricks: model output shown as HTML could run nothing.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def is_ui_path(path: str) -> bool:
    """The paths that serve the console's own files (no data: they need no API key)."""
    return path == "/" or path.startswith(UI_PREFIX)


@cache
def _read(name: str) -> bytes | None:
    path = (STATIC_DIR / name).resolve()
    if STATIC_DIR.resolve() not in path.parents or path.suffix not in _CONTENT_TYPES or not path.is_file():
        return None
    return path.read_bytes()


def ui_file(name: str) -> Response:
    """A console file by its path under static/, or a 404."""
    body = _read(name)
    if body is None:
        error = TokenmillError(f"no console file {name[:64]!r}")
        error.http_status, error.error_type = 404, "not_found_error"
        return error_response(error)
    return Response(body, media_type=_CONTENT_TYPES[Path(name).suffix], headers=SECURITY_HEADERS)


def add_ui_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return ui_file("index.html")

    @app.get(UI_PREFIX + "{name:path}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return ui_file(name)
