"""Tool-call parsers on the formats models write, the forced-call constraint, parser choice."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.server.tool_calls import (
    HermesParser, Llama3JsonParser, MistralParser, choose_tool_parser, forced_tool_calls, read_forced_calls,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}},
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes():
    parser = HermesParser()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me look." and _calls(calls) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    unterminated = '<tool_call>{"name": "now", "arguments": "{}"}'  # EOS before the closing tag; arguments as text
    content, calls = parser.parse(unterminated)
    assert content is None and _calls(calls) == [("now", {})]
    for broken in ["plain words", '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
                   "<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>']:
        assert parser.parse(broken) == (broken, [])


def test_mistral_and_llama3():
    content, calls = MistralParser().parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Oslo"})]
    assert MistralParser().parse("[TOOL_CALLS] nope") == ("[TOOL_CALLS] nope", [])
    llama = Llama3JsonParser()
    content, calls = llama.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                 '{"name": "now", "parameters": {}}')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"}), ("now", {})]
    assert llama.parse("The weather is fine.") == ("The weather is fine.", [])
    assert llama.parse('{"city": "no name"}') == ('{"city": "no name"}', [])


@pytest.mark.parametrize("text, end", [
    ("hello", 5), ("hello <tool", 6), ("hello <tool_call>{", 6), ("<", 0), ("a < b", 5), ("x<tool_cal", 1),
])
def test_content_end_holds_back_what_may_start_a_call(text, end):
    assert HermesParser().content_end(text) == end


def test_forced_constraints_and_reading_them():
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = forced_tool_calls(TOOLS, named, parallel=True)
    assert spec.json == TOOLS[0]["function"]["parameters"] and spec.param == "tool_choice"
    assert _calls(read_forced_calls('{"city": "Lima"}', named)) == [("get_weather", {"city": "Lima"})]
    required = forced_tool_calls(TOOLS, "required", parallel=False).json
    calls = [{"name": "get_weather", "parameters": {"city": "Kyiv"}}]
    jsonschema.validate(calls, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(calls * 2, required)  # parallel_tool_calls false: one call
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {"x": 1}, "extra": 1}], required)
    assert _calls(read_forced_calls(json.dumps(calls), "required")) == [("get_weather", {"city": "Kyiv"})]
    assert read_forced_calls('[{"name": "now", "param', "required") == []  # cut off by max_tokens
    assert forced_tool_calls(TOOLS, "auto", True) is None


def test_parser_choice():
    assert choose_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}", None) is None
    assert isinstance(choose_tool_parser("{{ tools }} <tool_call>", None), HermesParser)
    assert isinstance(choose_tool_parser("{{ tools }} [TOOL_CALLS]", None), MistralParser)
    assert isinstance(choose_tool_parser("{{ tools }} <|python_tag|>", None), Llama3JsonParser)
    assert isinstance(choose_tool_parser(None, "mistral"), MistralParser)
    with pytest.raises(InvalidParameterError, match="unknown tool-call parser"):
        choose_tool_parser("{{ tools }}", "nope")
