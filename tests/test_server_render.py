"""vLLM's render endpoints (what routers call to place a request by its prompt's tokens): the ids
are exactly those generation uses, and nothing is generated (in-process app, tiny engine)."""

from __future__ import annotations

import pytest
from server_harness import serve_app

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.server.app import build_app
from tokenmill.server.metrics import ServingMetrics
from tokenmill.server.serving_common import ServerContext

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river in Peru."}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a river up",
                                            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


@pytest.fixture
def server(tiny_llm, tmp_path):
    metrics = ServingMetrics("tiny")
    app = build_app(ServerContext(AsyncLLMEngine(tiny_llm.engine, step_observer=metrics.observe_step), "tiny", metrics))
    with serve_app(app, tmp_path) as running:
        yield running


def test_chat_render_gives_the_prompt_ids_generation_uses(server):
    rendered = server.post("/v1/chat/completions/render", {"model": "tiny", "messages": MESSAGES})
    assert rendered.status == 200
    body = rendered.json()
    assert body["model"] == "tiny" and body["request_id"].startswith("chatcmpl-")
    tokenized = server.post("/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert body["token_ids"] == tokenized
    reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}).json()
    assert reply["usage"]["prompt_tokens"] == len(body["token_ids"])
    generated = server.metric("tokenmill:generation_tokens_total")
    assert server.post("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 50}).status == 200
    assert server.metric("tokenmill:generation_tokens_total") == generated  # rendering generates nothing


def test_chat_render_follows_the_tool_plan(server):
    """The tiny model's template never mentions tools: generation refuses tools, so does render;
    tool_choice "none" renders no tools, as generation does."""
    without = server.post("/v1/chat/completions/render", {"messages": MESSAGES}).json()
    none = server.post("/v1/chat/completions/render", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert none.json()["token_ids"] == without["token_ids"]
    refused = server.post("/v1/chat/completions/render", {"messages": MESSAGES, "tools": TOOLS})
    generated = server.post("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2})
    assert refused.status == generated.status == 400
    assert refused.json()["error"]["message"] == generated.json()["error"]["message"]


def test_completion_render_gives_each_prompts_ids(server):
    texts = ["The longest river in Peru is", "Lima is"]
    rendered = server.post("/v1/completions/render", {"model": "tiny", "prompt": texts})
    assert rendered.status == 200
    first, second = rendered.json()
    assert first["token_ids"] == server.post("/tokenize", {"prompt": texts[0]}).json()["tokens"]
    assert second["token_ids"] == server.post("/tokenize", {"prompt": texts[1]}).json()["tokens"]
    assert first["request_id"].endswith("-0") and second["request_id"].endswith("-1")
    ids = server.post("/v1/completions/render", {"prompt": [[5, 6, 7]]}).json()
    assert [r["token_ids"] for r in ids] == [[5, 6, 7]]


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/v1/chat/completions/render", {"model": "other", "messages": MESSAGES}, 404),
    ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404),
    ("/v1/chat/completions/render", {"messages": "not a list"}, 400),
    ("/v1/completions/render", {"prompt": [[1, 2], [10 ** 9]]}, 400),
    ("/v1/completions/render", {"prompt": "x" * 10_000_000}, 400),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 100_000}, 400),  # cannot fit
])
def test_render_refuses_what_generation_refuses(server, path, body, status):
    response = server.post(path, body)
    assert response.status == status, response.body
    assert "error" in response.json()
