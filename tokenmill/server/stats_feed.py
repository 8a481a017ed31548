"""The console's feed: the server's figures once per interval, shared by every subscriber, with a
history of the last minutes for the charts. Served as JSON (/v1/stats) and as server-sent events
(/v1/stats/stream); the numbers are those /metrics reports at the same instant."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator

from tokenmill.server.metrics import ServingMetrics

# the figures each history point keeps, from the snapshot's window
_HISTORY_WINDOW_KEYS = (
    "output_tokens_per_second", "prefill_tokens_per_second", "time_to_first_token_p50_seconds",
    "time_to_first_token_p99_seconds", "inter_token_latency_p50_seconds", "inter_token_latency_p99_seconds",
    "cost_per_1m_output_tokens", "cost_per_1m_total_tokens", "engine_busy_fraction",
)


def history_point(snapshot: dict) -> dict:
    """What the charts plot of one snapshot."""
    engine, window = snapshot["engine"], snapshot["window"]
    point = {"time": snapshot["time"], "num_requests_running": engine.get("num_requests_running", 0),
             "num_requests_waiting": engine.get("num_requests_waiting", 0),
             "kv_cache_usage": engine["kv_cache"]["usage"] if engine else 0.0}
    point.update({key: window.get(key) for key in _HISTORY_WINDOW_KEYS})
    return point


class StatsFeed:
    """Ticks every `interval` seconds on the server's event loop (start it with `run()`)."""

    def __init__(self, metrics: ServingMetrics, facts: dict, interval: float = 1.0,
                 history_seconds: float = 600.0) -> None:
        self.metrics = metrics
        self.facts = facts
        self.interval = interval
        self.history: deque[dict] = deque(maxlen=max(1, round(history_seconds / interval)))
        self.latest: dict | None = None
        self.closed = False  # set by close(), from any thread
        self._ticked: asyncio.Event | None = None

    def close(self) -> None:
        """End every subscriber's stream at the next tick (the server is about to exit: an open
        dashboard must not hold its shutdown)."""
        self.closed = True

    def snapshot(self, now: float | None = None) -> dict:
        return {**self.metrics.snapshot(now), "facts": self.facts}

    def tick(self, now: float | None = None) -> dict:
        self.latest = self.snapshot(now)
        self.history.append(history_point(self.latest))
        if self._ticked is not None:  # wake every subscriber; they wait for the next tick on a fresh event
            ticked, self._ticked = self._ticked, asyncio.Event()
            ticked.set()
        return self.latest

    async def run(self) -> None:
        """Tick until cancelled (the app's lifespan owns the task)."""
        self._ticked = asyncio.Event()
        try:
            while True:
                self.tick(time.time())
                await asyncio.sleep(self.interval)
        finally:
            self._ticked = None

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events: the present snapshot with the history, then each tick's snapshot."""
        yield _sse({**self.snapshot(), "history": list(self.history)})
        while not self.closed:
            if self._ticked is None:  # not running (an app without its lifespan): tick ourselves
                await asyncio.sleep(self.interval)
                yield _sse(self.snapshot())
                continue
            await self._ticked.wait()
            if not self.closed:
                yield _sse(self.latest)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
