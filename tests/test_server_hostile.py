"""Hostile requests against a real server: each gets its 4xx and a message naming the problem, none
reaches the engine, and three normal streams running alongside finish with the tokens they get alone."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_harness import read_event, start_server, wait_until

from tokenmill import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about mills."}]
LONG_TEXT = "grain " * 200_000  # 1.2 M characters: more than 512 tokens of the longest token could hold

HOSTILE = [
    # (path, body (dict, or raw bytes), status, words the message must contain)
    # huge integers
    ("/v1/completions", {"prompt": "x", "n": 2**64}, 400, ["n"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, 400, ["max_tokens", "512"]),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**64, "max_tokens": 4}, 400, ["min_tokens"]),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, ["seed"]),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**64}, 400, ["logprobs"]),
    ("/v1/completions", {"prompt": [2**63]}, 400, ["token ids"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(2**64): 1}}, 400, ["logit_bias"]),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 18446744073709551616}, 400, ["min_tokens"]),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2**64}, 400, ["top_logprobs"]),
    # negative, NaN and infinite floats
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, ["temperature"]),
    ("/v1/completions", {"prompt": "x", "top_p": -0.5}, 400, ["top_p"]),
    ("/v1/completions", {"prompt": "x", "presence_penalty": "NaN"}, 400, ["presence_penalty"]),
    ("/v1/completions", {"prompt": "x", "min_p": "-inf"}, 400, ["min_p"]),
    ("/v1/completions", b'{"prompt": "x", "frequency_penalty": 1e999}', 400, ["frequency_penalty"]),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, ["not valid JSON"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": "NaN"}}, 400, ["logit_bias"]),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, ["repetition_penalty"]),
    # huge lists
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 10_000}, 400, ["stop"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(5000)}}, 400, ["logit_bias"]),
    ("/v1/completions", {"prompt": ["x"] * 1000}, 400, ["at most 64 prompts"]),
    ("/v1/completions", {"prompt": [1] * 100_000}, 400, ["max_model_len"]),
    ("/v1/chat/completions", {"messages": CHAT * 5000}, 400, ["messages"]),
    # deep nesting
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, ["nested too deeply"]),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, ["nested too deeply"]),
    ("/v1/completions", {"prompt": [[[[1]]]]}, 400, ["prompt"]),
    ("/v1/chat/completions", {"messages": CHAT, "extra": json.loads("[" * 500 + "]" * 500)}, 200, []),
    # wrong types
    ("/v1/completions", {"prompt": 5}, 400, ["prompt"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, ["max_tokens"]),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, ["stop"]),
    ("/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, 400, ["logit_bias"]),
    ("/v1/completions", {"prompt": "x", "stream_options": "yes"}, 400, ["stream_options"]),
    ("/v1/completions", {"prompt": "x", "echo": {"a": 1}}, 400, ["echo"]),
    ("/v1/chat/completions", {"messages": "hi"}, 400, ["messages"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, ["content"]),
    ("/v1/chat/completions", {"messages": [{"role": "user"}] * 2, "n": "many"}, 400, ["n"]),
    ("/tokenize", {"prompt": ["a", "b"]}, 400, ["prompt"]),
    ("/detokenize", {"tokens": "abc"}, 400, ["tokens"]),
    ("/v1/completions", b'"just a string"', 400, ["JSON object"]),
    # invalid Unicode and control characters
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, ["Unicode"]),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', 400, ["Unicode"]),
    ("/tokenize", b'{"prompt": "\\uDBFF"}', 400, ["Unicode"]),
    ("/v1/completions", b'{"prompt": "\\ud83d\\ude00 a real pair", "max_tokens": 2}', 200, []),
    ("/v1/completions", {"prompt": "x", "model": "evil\n\x00\x1b[31mmodel"}, 404, ["does not exist"]),
    # over-long strings
    ("/v1/completions", {"prompt": LONG_TEXT}, 400, ["characters", "can fit"]),
    ("/tokenize", {"prompt": LONG_TEXT}, 400, ["characters"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]}, 400, ["characters"]),
    ("/v1/completions", {"prompt": "x", "stop": ["s" * 5000]}, 400, ["stop", "1024"]),
    ("/v1/completions", {"prompt": "x", "model": "m" * 100_000}, 404, ["does not exist"]),
    ("/detokenize", {"tokens": [1] * 10_000}, 400, ["tokens", "512"]),
    # unknown models
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-5"}, 404, ["gpt-5"]),
    ("/tokenize", {"prompt": "x", "model": "nope"}, 404, ["nope"]),
    # huge n x prompts
    ("/v1/completions", {"prompt": ["x"] * 64, "n": 16}, 400, ["tokens", "per request"]),
    ("/v1/completions", {"prompt": ["x"] * 5, "n": 16, "max_tokens": 1}, 400, ["80 sequences", "64"]),
    ("/v1/completions", {"prompt": ["x"] * 4, "n": 16, "max_tokens": 500}, 400, ["tokens", "per request"]),
    ("/v1/chat/completions", {"messages": CHAT, "n": 17}, 400, ["n"]),
    # accepted, and harmless to everyone else: top_k beyond the vocabulary means "no top-k"
    ("/v1/completions", {"prompt": "x", "max_tokens": 5, "top_k": 1180591620717411303424}, 200, []),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5, "top_k": 2**63}, 200, []),
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-queued-requests", "64"],
                           tmp_path_factory.mktemp("hostile"))
    yield process
    assert process.stop() == 0, process.log()
    log = process.log()
    assert "Traceback" not in log and "RecursionError" not in log


def _send(server, path, body):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return server.request("POST", path, raw=raw)


def _stream(server, prompt: str) -> list[int]:
    conn, response = server.open_stream("/v1/completions", {"prompt": prompt, "max_tokens": 120, "ignore_eos": True,
                                                             "temperature": 0, "logprobs": 0})
    assert response.status == 200
    tokens, finish = [], None
    while (event := read_event(response)) not in (None, "[DONE]"):
        assert "error" not in event, event
        for choice in event["choices"]:
            tokens += choice["logprobs"]["tokens"]
            finish = choice["finish_reason"] or finish
    conn.close()
    assert finish == "length"
    return tokens


def test_hostile_requests_get_4xx_while_normal_streams_complete(server, tiny_llm):
    prompts = ["The mill wheel turns", "Water under the bridge", "Flour, salt and yeast"]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, logprobs=0)
    alone = [[lp[t].decoded_token for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
             for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(_stream, server, p) for p in prompts]
        results = list(pool.map(lambda case: (case, _send(server, case[0], case[1])), HOSTILE))
        for (path, body, status, words), result in results:
            name = f"{path} {body if isinstance(body, bytes) else json.dumps(body)}"[:120]
            assert result.status == status, (name, result.status, result.body[:300])
            if status >= 400:
                error = result.json()["error"]
                assert error["code"] == status and error["type"], name
                for word in words:
                    assert word in error["message"], (name, error["message"][:300])
        assert [s.result(timeout=120) for s in streams] == alone
    assert server.request("GET", "/health").status == 200
    assert server.wait_for(lambda: server.metric("tokenmill:kv_cache_usage_perc") == 0.0, 10)


def test_a_forged_log_line_is_escaped(server):
    server.request("GET", "/v1/models%0a127.0.0.1%20GET%20/forged%20200")
    wait_until(lambda: "/v1/models\\n127.0.0.1" in server.log(), timeout=10)  # the access line follows the response
    assert "\n127.0.0.1 GET /forged 200" not in server.log()
    assert "/v1/models\\n127.0.0.1" in server.log()


def test_request_id_is_honoured_sanitized_and_echoed(server):
    result = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2},
                         headers={"X-Request-Id": "abc-123_x.y:z \t<script>%00" + "a" * 300})
    echoed = result.headers["x-request-id"]
    assert echoed.startswith("abc-123_x.y:zscript00aaa") and len(echoed) == 128
    assert result.json()["id"] == f"cmpl-{echoed}"
    again = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": echoed})
    assert again.status == 200  # the same id twice is the client's business, not an engine clash
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).headers["x-request-id"]


def test_models_lists_names_not_paths(server, tiny_llama_dir):
    card = server.request("GET", "/v1/models").json()["data"][0]
    assert card["id"] == tiny_llama_dir.name and str(tiny_llama_dir) not in json.dumps(card)
    by_path = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": str(tiny_llama_dir)})
    assert by_path.status == 200
