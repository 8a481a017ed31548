"""Schemathesis fuzzes every operation of the server's OpenAPI schema (request bodies included):
no 5xx, and the server is healthy afterwards. Fixed seed, a bounded number of examples."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from server_harness import start_server

pytestmark = pytest.mark.slow
EXAMPLES = {"POST": 100, "GET": 10}  # per operation


@pytest.fixture(scope="module")
def fuzzed_server(tiny_llama_dir, tmp_path_factory):
    # a short context bounds what any accepted request can make the engine do
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--max-model-len", "128"],
                           tmp_path_factory.mktemp("fuzz"))
    yield process
    assert process.request("GET", "/health").status == 200  # healthy after everything
    assert process.wait_for(lambda: process.metric("tokenmill:kv_cache_usage_perc") == 0.0, 30)
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def test_the_schema_describes_the_request_bodies(fuzzed_server):
    spec = fuzzed_server.request("GET", "/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_operation_answers_5xx(fuzzed_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    if mode is GenerationMode.NEGATIVE:  # bodies that break the schema; GET operations have nothing to break
        operations = [op for op in operations if op.method.upper() == "POST"]
    failures = []
    for operation in operations:
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=EXAMPLES[operation.method.upper()], derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            case.call_and_validate(checks=[not_a_server_error], timeout=60)

        try:
            fuzz()
        except Exception as exc:  # keep going: report every operation that failed
            failures.append(f"{operation.method.upper()} {operation.path}: {str(exc)[:1500]}")
    assert not failures, "\n\n".join(failures)
