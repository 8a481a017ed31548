"""The console's files and its feed over HTTP (in-process app on the tiny engine): what is served,
with which headers, what the API key guards, --no-ui, and the feed against /metrics."""

from __future__ import annotations

import http.client
import json
import re

import pytest
from server_harness import read_event, serve_app, wait_until

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.device_peaks import DevicePeaks
from tokenmill.engine.metrics import CostModel, UtilizationWindow
from tokenmill.server.app import build_app
from tokenmill.server.metrics import ServingMetrics
from tokenmill.server.serving_common import ServerContext
from tokenmill.server.ui import CONTENT_SECURITY_POLICY, STATIC_DIR

KEY = "ui-test-key"


def _app(tiny_llm, **kwargs):
    cost = CostModel(1000, 1e4, 10.0, 8.0, DevicePeaks(1e12, 1e10), cost_per_hour=1.0)
    metrics = ServingMetrics("tiny", UtilizationWindow(cost, 60.0))
    engine = AsyncLLMEngine(tiny_llm.engine, step_observer=metrics.observe_step)
    return build_app(ServerContext(engine, "tiny", metrics), **kwargs)


@pytest.fixture
def server(tiny_llm, tmp_path):
    with serve_app(_app(tiny_llm, stats_interval=0.1), tmp_path) as running:
        yield running
    assert tiny_llm.engine.kv_cache.stats().num_used_blocks == 0


def test_console_files_are_served_with_a_restrictive_csp(server):
    index = server.request("GET", "/")
    assert index.status == 200 and index.headers["content-type"].startswith("text/html")
    html = index.body.decode()
    assets = re.findall(r'(?:src|href)="(/ui/[^"]+)"', html)
    assert "/ui/vendor/uPlot.iife.min.js" in assets and "/ui/console.js" in assets
    for path in ["/", *assets, "/ui/api.js", "/ui/dashboard.js", "/ui/playground.js", "/ui/markdown.js", "/ui/dom.js"]:
        response = server.request("GET", path)
        assert response.status == 200, path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert response.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self';" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert server.request("GET", "/ui/console.js").headers["content-type"].startswith("text/javascript")
    assert "<script>" not in html  # no inline script: the CSP would refuse it anyway


@pytest.mark.parametrize("path", ["/ui/../app.py", "/ui/%2e%2e/app.py", "/ui/..%2fapp.py", "/ui/nothing.js",
                                  "/ui/vendor/README.md", "/ui/vendor/"])
def test_only_console_files_are_served(server, path):
    response = server.request("GET", path)
    assert response.status == 404
    assert response.json()["error"]["type"] == "not_found_error"


def test_the_console_is_offline_and_vendors_its_chart_library():
    """No CDN: every script and style is a package file; the chart library is pinned with its license."""
    for path in STATIC_DIR.rglob("*"):
        if path.suffix in (".html", ".css") or path.name in ("console.js", "dashboard.js", "playground.js", "api.js",
                                                             "dom.js"):
            assert not re.search(r"(src|href|url)\s*[=(]\s*[\"']?(https?:)?//", path.read_text()), path
    vendor = STATIC_DIR / "vendor"
    assert "1.6.32" in (vendor / "README.md").read_text()
    assert "MIT License" in (vendor / "uPlot.LICENSE").read_text()
    assert (vendor / "uPlot.iife.min.js").stat().st_size > 40_000


def test_feed_streams_snapshots_with_history_then_ticks(server):
    server.post("/v1/completions", {"prompt": "hello", "max_tokens": 4})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/v1/stats/stream")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    first = read_event(response)
    assert isinstance(first["history"], list) and first["facts"]["model_name"] == "tiny"
    facts = first["facts"]
    assert facts["architecture"] == "llama" and facts["dtype"] == "float32" and facts["num_kv_blocks"] > 0
    assert facts["max_num_seqs"] == 256 and facts["tensor_parallel_size"] == 1 and facts["cost_per_hour"] == 1.0
    assert first["totals"]["generation_tokens"] == 4
    times = [first["time"]]
    for _ in range(3):  # a tick every 0.1 s
        event = read_event(response)
        assert "history" not in event
        times.append(event["time"])
    conn.close()
    assert times == sorted(times) and times[-1] - times[0] < 2
    assert wait_until(lambda: len(server.request("GET", "/v1/stats").json()["recent_requests"]) == 1)


def test_feed_equals_metrics_of_a_live_server(server):
    for i in range(3):
        server.post("/v1/completions", {"prompt": f"hello {i}", "max_tokens": 5, "n": 2})
    stats = server.request("GET", "/v1/stats").json()
    assert stats["totals"]["generation_tokens"] == 30 == server.metric("tokenmill:generation_tokens_total")
    assert stats["totals"]["prompt_tokens"] == server.metric("tokenmill:prompt_tokens_total")
    assert stats["totals"]["requests_finished"] == server.metric("tokenmill:request_success_total") == 3
    kv = stats["engine"]["kv_cache"]
    assert kv["prefix_cache_hits"] == server.metric("tokenmill:prefix_cache_hits_total")
    assert kv["prefix_cache_queries"] == server.metric("tokenmill:prefix_cache_queries_total") > 0
    assert kv["usage"] == server.metric("tokenmill:kv_cache_usage_perc") == 0.0
    assert stats["engine"]["num_requests_running"] == server.metric("tokenmill:num_requests_running") == 0
    assert stats["window"]["time_to_first_token_p50_seconds"] > 0
    assert server.metric("tokenmill:time_to_first_token_p50_seconds") > 0
    assert [r["status"] for r in stats["recent_requests"]] == ["finished"] * 3
    assert all(r["output_tokens"] == 10 for r in stats["recent_requests"])


def test_response_id_is_the_consoles_request_id(server):
    response = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).json()
    recent = server.request("GET", "/v1/stats").json()["recent_requests"]
    assert recent[0]["request_id"].startswith(response["id"])  # cmpl-<id>-<prompt index>


def test_api_key_guards_the_feed_but_not_the_page(tiny_llm, tmp_path):
    with serve_app(_app(tiny_llm, api_key=KEY), tmp_path) as keyed:
        assert keyed.request("GET", "/", headers={"Authorization": ""}).status == 200
        assert keyed.request("GET", "/ui/console.js", headers={"Authorization": ""}).status == 200
        for path in ("/v1/stats/stream", "/v1/stats", "/metrics", "/v1/models"):
            assert keyed.request("GET", path, headers={"Authorization": ""}).status == 401, path
            assert keyed.request("GET", path, headers={"Authorization": "Bearer nope"}).status == 401, path
        conn = http.client.HTTPConnection("127.0.0.1", keyed.port, timeout=10)
        conn.request("GET", "/v1/stats/stream", headers={"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200 and "facts" in read_event(response)
        conn.close()


def test_no_ui_serves_no_page_and_keeps_the_feed(tiny_llm, tmp_path):
    with serve_app(_app(tiny_llm, ui=False, api_key=KEY), tmp_path, api_key=KEY) as plain:
        assert plain.request("GET", "/").status == 404
        assert plain.request("GET", "/ui/console.js").status == 404
        assert plain.request("GET", "/", headers={"Authorization": ""}).status == 401  # nothing public but /health
        stats = plain.request("GET", "/v1/stats").json()
        assert stats["facts"]["ui"] is False
        assert json.dumps(stats)  # plain JSON, no NaN
