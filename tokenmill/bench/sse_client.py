"""A minimal asyncio HTTP/1.1 client for streamed OpenAI requests, timing every event.

Hand-rolled on purpose: a load generator must cost the machine (often the server's machine) far less
than the server it measures, and this one does little more than split bytes.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class StreamRecord:
    """What one streamed request measured. Times are seconds from time.perf_counter()."""

    start: float
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each event that carried text
    output_tokens: int = 0  # from the usage chunk
    prompt_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


async def stream_request(base_url: str, path: str, body: dict, api_key: str | None = None,
                         timeout: float = 600.0) -> StreamRecord:
    """POST `body` with stream=true and include_usage; never raises for HTTP or stream errors."""
    record = StreamRecord(start=time.perf_counter())
    try:
        await asyncio.wait_for(_run(base_url, path, body, api_key, record), timeout)
    except Exception as exc:  # a failed request is a data point, not a crash of the benchmark
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.perf_counter()
    return record


async def _run(base_url: str, path: str, body: dict, api_key: str | None, record: StreamRecord) -> None:
    url = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        payload = json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()
        auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        writer.write(
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        await writer.drain()
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode().partition(":")
            headers[key.strip().lower()] = value.strip()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {(await reader.read())[:300].decode(errors='replace')}")
        chunked = headers.get("transfer-encoding") == "chunked"
        buffer = b""
        async for data in _body_pieces(reader, chunked):
            buffer += data
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                _on_event(event, record)
    finally:
        writer.close()


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after each chunk


def _on_event(event: bytes, record: StreamRecord) -> None:
    if not event.startswith(b"data: "):
        return
    data = event[6:]
    if data == b"[DONE]":
        return
    now = time.perf_counter()
    message = json.loads(data)
    if "error" in message:
        raise RuntimeError(message["error"].get("message", "stream error"))
    for choice in message.get("choices", ()):
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content") or ""
        if piece:
            if record.first_token is None:
                record.first_token = now
            record.token_times.append(now)
            record.text += piece
    if message.get("usage"):
        record.output_tokens = message["usage"]["completion_tokens"]
        record.prompt_tokens = message["usage"]["prompt_tokens"]
