"""Tool calling: the constraint that enforces `tool_choice` "required" or a named function, and the
parsers that find tool calls in what a model wrote under "auto" (Hermes/Qwen `<tool_call>` JSON,
Llama 3.x JSON, Mistral `[TOOL_CALLS]`).

"required" and named choices do not depend on the model's own format: the output is constrained
to JSON (a named function's arguments, or an array of {"name", "parameters"}) and read as such,
as vLLM does; so the arguments always parse and match the function's parameters schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import StructuredOutputsParams


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def forced_tool_calls(tools: list[dict], tool_choice: str | dict, parallel: bool) -> StructuredOutputsParams | None:
    """The constraint of "required" (one or more calls: an array of {"name", "parameters"}) or of
    a named function (its arguments object); None for "auto" and "none"."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(function), param="tool_choice")
    if tool_choice != "required":
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t["function"])}}
             for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, param="tool_choice")


def read_forced_calls(text: str, tool_choice: str | dict) -> list[ToolCall]:
    """The tool calls of an output that `forced_tool_calls` constrained (an output cut short by
    max_tokens does not parse: no calls)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in value]


class ToolParser:
    """Finds the tool calls in a model's text. `start` is the text a call begins with: what comes
    before it is content, and a stream holds back anything from it on."""

    name = ""
    start = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls (and the whole text as content) when none parses."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a partial output is content for sure: up to a call's start, or to where a
        suffix could still become one."""
        found = text.find(self.start)
        if found >= 0:
            return found
        for keep in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)


def _call(value, argument_key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(argument_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class _MarkedCallsParser(ToolParser):
    """Formats whose calls follow a marker: content before it, calls from it on."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        found = text.find(self.start)
        calls = None if found < 0 else self.read_calls(text[found:])
        if not calls or None in calls:
            return text, []
        return text[:found].strip() or None, calls

    def read_calls(self, text: str) -> list[ToolCall | None] | None:
        """The calls in `text` (which starts with the marker); None or a None call where one does not parse."""
        raise NotImplementedError


class HermesParser(_MarkedCallsParser):
    """Hermes / Qwen 2.5 / Qwen 3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one or more."""

    name = "hermes"
    start = "<tool_call>"

    def read_calls(self, text: str) -> list[ToolCall | None] | None:
        return [_json_call(body, "arguments") for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text,
                                                                      re.DOTALL)]


class MistralParser(_MarkedCallsParser):
    """Mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]."""

    name = "mistral"
    start = "[TOOL_CALLS]"

    def read_calls(self, text: str) -> list[ToolCall | None] | None:
        try:
            values = json.loads(text[len(self.start):])
        except ValueError:
            return None
        return [_call(v, "arguments") for v in (values if isinstance(values, list) else [values])]


def _json_call(text: str, argument_key: str) -> ToolCall | None:
    try:
        return _call(json.loads(text), argument_key)
    except ValueError:
        return None


class Llama3JsonParser(ToolParser):
    """Llama 3.x: the whole reply is {"name": ..., "parameters": {...}} (after an optional
    <|python_tag|>), several separated by ';'."""

    name = "llama3_json"
    start = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body[len(self.start):] if body.startswith(self.start) else body
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        rest = body
        while rest:
            try:
                value, end = decoder.raw_decode(rest)
            except ValueError:
                return text, []
            call = _call(value, "parameters") or _call(value, "arguments")
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].strip().removeprefix(";").strip()
        return None, calls

    def content_end(self, text: str) -> int:
        # a reply that starts like JSON may be a call: hold it all back
        return 0 if text.lstrip().startswith(("{", self.start[:1])) or not text.strip() else len(text)


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser)}


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def choose_tool_parser(chat_template: str | None, name: str | None) -> ToolParser | None:
    """--tool-call-parser, else the format the chat template writes; None for a template without tools."""
    if name is not None:
        if name not in TOOL_PARSERS:
            raise InvalidParameterError(f"unknown tool-call parser {name!r}; choose from {', '.join(TOOL_PARSERS)}")
        return TOOL_PARSERS[name]()
    if not template_supports_tools(chat_template):
        return None
    if "[TOOL_CALLS]" in chat_template:
        return MistralParser()
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3JsonParser()
    return HermesParser()
