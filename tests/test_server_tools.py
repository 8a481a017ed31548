"""Tool calling, reasoning (--reasoning-parser qwen3) and vLLM's template extras through a real
`tokenmill serve` and the official openai SDK: the tiny model with a Hermes-style chat template of
our own (--chat-template, with Qwen3's enable_thinking switch),
and the default template, which has no tools. The tiny model writes noise: named and "required" calls parse because they are constrained;
"auto" is tested with its output forced into the Hermes format by a regex."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_harness import start_server

TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    (folder / "template.jinja").write_text(TEMPLATE)
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32", "--reasoning-parser", "qwen3",
                            "--chat-template", str(folder / "template.jinja")], folder)
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def _validate(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_choice_always_parses(client, model):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
        _validate(choice.message.tool_calls)


def test_required_choice_calls_some_tool(client, model):
    # one call (parallel_tool_calls false): a random model never closes an open-ended array of calls
    names = set()
    for seed in range(4):
        reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=300)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _validate(choice.message.tool_calls)
        names |= {c.function.name for c in choice.message.tool_calls}
    assert names <= set(SCHEMAS)


FORCED_HERMES = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,6}", '
                 r'"unit": "celsius"\}\}</tool_call>')


def test_auto_reads_the_models_own_format(client, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": FORCED_HERMES}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    _validate(choice.message.tool_calls)
    plain = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": "Sunny and [0-9]{2} degrees"}})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content.startswith("Sunny")


@pytest.mark.parametrize("kwargs", [
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0},
    {"tool_choice": "required", "temperature": 0},
    {"extra_body": {"structured_outputs": {"regex": FORCED_HERMES}}, "temperature": 0},
    {"extra_body": {"structured_outputs": {"regex": "Sunny and [0-9]{2} degrees"}}, "temperature": 0},
], ids=["named", "required", "auto-call", "auto-text"])
def test_streamed_deltas_reassemble_to_the_reply(client, model, kwargs):
    whole = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200, **kwargs)
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason
    assert content == (message.content or "")
    expected = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(entry["id"].startswith("call_") for entry in calls.values())


THINKING = r"<think>\n[a-z]{3,8}( [a-z]{2,8}){1,3}\.\n</think>\n\nSunny and [0-9]{2} degrees\."
THINKING_THEN_CALL = r"<think>[a-z]{4}</think>\n<tool_call>\{\"name\": \"get_time\", \"arguments\": \{\"zone\": \"[A-Z]{3}\"\}\}</tool_call>"


def test_reasoning_goes_out_of_the_content(client, model):
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=5,
                                           extra_body={"structured_outputs": {"regex": THINKING}})
    message = reply.choices[0].message
    assert re.fullmatch(r"[a-z]{3,8}( [a-z]{2,8}){1,3}\.", message.model_extra["reasoning_content"])
    assert re.fullmatch(r"Sunny and [0-9]{2} degrees\.", message.content)
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": "No thoughts [0-9]"}})
    assert plain.choices[0].message.model_extra["reasoning_content"] is None
    assert plain.choices[0].message.content.startswith("No thoughts")


@pytest.mark.parametrize("regex, tools", [(THINKING, None), (THINKING_THEN_CALL, TOOLS)], ids=["text", "tool-call"])
def test_streamed_reasoning_reassembles(client, model, regex, tools):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=100, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}}, **({"tools": tools} if tools else {}))
    whole = client.chat.completions.create(**kwargs).choices[0]
    reasoning, content, calls = "", "", []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        calls += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert content == (whole.message.content or "")
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if tools:
        assert whole.finish_reason == "tool_calls" and whole.message.content is None and len(calls) == 1


def test_a_round_trip_renders_through_the_template(client, model, server):
    first = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    rendered = server.post("/tokenize", {"messages": history, "tools": TOOLS, "return_prompt": True}).json()["prompt"]
    arguments = json.loads(call.function.arguments)
    assert '"name": "get_weather"' in rendered and json.dumps(arguments) in rendered  # arguments as an object
    assert f'<tool_response id="{call.id}">{{"temperature": 21}}</tool_response>' in rendered
    assert '{"type": "function", "function": {"name": "get_time"' in rendered  # the tools, from the template
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=5)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_chat_template_kwargs_reach_the_template(client, model, server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    thinking = server.post("/tokenize", {"messages": MESSAGES, "return_prompt": True}).json()
    no_thinking = server.post("/tokenize", {"messages": MESSAGES, "return_prompt": True, **off}).json()
    assert thinking["prompt"].endswith("<|im_start|>assistant\n")
    assert no_thinking["prompt"] == thinking["prompt"] + "<think>\n\n</think>\n\n"
    for extra, rendered in ((off, no_thinking), ({}, thinking)):  # what the engine got: the same prompt
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, extra_body=extra)
        assert reply.usage.prompt_tokens == rendered["count"]


def test_continue_final_message_goes_on_with_the_last_message(client, model, server):
    history = MESSAGES + [{"role": "assistant", "content": "It is sunny and"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    rendered = server.post("/tokenize", {"messages": history, "return_prompt": True, **extra}).json()
    assert rendered["prompt"].endswith("<|im_start|>assistant\nIt is sunny and")
    reply = client.chat.completions.create(model=model, messages=history, max_tokens=1, extra_body=extra)
    assert reply.usage.prompt_tokens == rendered["count"]
    closed = server.post("/tokenize", {"messages": history, "return_prompt": True,
                                       "add_generation_prompt": False}).json()
    assert closed["prompt"].endswith("It is sunny and<|im_end|>\n")


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "constrains the output"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "function"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tool_requests_are_400s(client, model, kwargs, param, message):
    body = {"tools": TOOLS, **kwargs}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert caught.value.body["param"] == param and message in caught.value.body["message"]


def test_history_messages_are_checked(client, model):
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(model=model, max_tokens=5,
                                       messages=MESSAGES + [{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def plain_server(tiny_llama_dir, tmp_path_factory):
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path_factory.mktemp("plain"))
    yield process
    assert process.stop() == 0, process.log()


def test_a_template_without_tools_refuses_them(plain_server):
    client = openai.OpenAI(base_url=plain_server.base_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="does not support tools") as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=5)
    assert caught.value.body["param"] == "tools"
    reply = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                           max_tokens=3)
    assert reply.choices[0].message.tool_calls is None
