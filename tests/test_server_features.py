"""What apps and eval harnesses use beyond plain generation, through a real `tokenmill serve` on the
tiny model and the official openai SDK: structured outputs, prompt logprobs (lm-eval's echo +
logprobs), the refusals of what we do not implement, /v1/models/{id}. The tiny model's weights are
random: what validates here validates because of the constraint."""

from __future__ import annotations

import json
import re
import threading
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import start_server

from tokenmill import SamplingParams


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    pets: list[Literal["cat", "dog", "fish"]] = Field(max_length=2)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rank": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["city", "rank"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"],
                           tmp_path_factory.mktemp("structured"))
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def test_sdk_parse_returns_the_pydantic_object(client, model):
    for seed in (1, 2):
        completion = client.chat.completions.parse(model=model, messages=MESSAGES, response_format=Person,
                                                   max_tokens=300, temperature=1.0, seed=seed)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_json_schema_streamed_and_not(client, model):
    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format,
                                           max_tokens=300, temperature=0)
    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    stream = client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format,
                                            max_tokens=300, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_completions_take_structured_outputs(client, model):
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    completion = client.completions.create(model=model, prompt="Street:", max_tokens=40, n=3, temperature=1.0,
                                           extra_body={"structured_outputs": {"regex": regex}})
    for choice in completion.choices:
        assert re.fullmatch(regex, choice.text) and choice.finish_reason == "stop"
    chosen = client.completions.create(model=model, prompt="Pick:", max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert chosen.choices[0].text in ("left", "right")
    listed = client.completions.create(model=model, prompt="JSON:", max_tokens=200, temperature=0,  # vLLM's extra
                                       extra_body={"response_format": {"type": "json_schema",
                                                                       "json_schema": {"name": "p", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(listed.choices[0].text), SCHEMA)


BAD_REQUESTS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "invalid JSON schema: Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                 "schema": {"type": "string", "pattern": "(("}}}},
     "response_format", "unclosed group"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "Input should be"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs", "invalid regular expression"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice must be a list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": {"type": "object"}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "Extra inputs"),
    ({"structured_outputs": {"grammar": "x" * 70_000}}, "structured_outputs", "at most 65536"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
    ({"guided_json": {"type": "object"}}, "guided_json", "use structured_outputs"),
    ({"guided_choice": ["a"]}, "guided_choice", "use structured_outputs"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "generates text only"),
    ({"modalities": ["text", "audio"]}, "modalities", "only"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "no web search"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"function_call": "auto"}, "function_call", "not supported"),
    ({"best_of": 3}, "best_of", "not supported"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ({"bad_words": ["x"]}, "bad_words", "not supported"),
    ({"cache_salt": "tenant-a"}, "cache_salt", "shared"),
    ({"priority": 3}, "priority", "first come"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "--chat-template"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    ({"stop_token_ids": [10 ** 6]}, "stop_token_ids", "must be in [0,"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 or in [1,"),
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "its own field"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages.0.content", "content parts of type 'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "messages.0.content", "'input_audio' are not supported"),
]


def test_bad_requests_are_400s_naming_the_problem_while_others_run(client, model):
    streamed: list[str] = []

    def long_request() -> None:  # runs through all the refusals below
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=300, stream=True,
                                                extra_body={"ignore_eos": True})
        streamed.extend(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    thread = threading.Thread(target=long_request)
    thread.start()
    for extra, param, message in BAD_REQUESTS:
        body = {"messages": MESSAGES, **extra}
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, max_tokens=5, **{"messages": body.pop("messages")},
                                           extra_body=body)
        error = caught.value.body
        assert caught.value.status_code == 400, extra
        assert error["param"] == param and message in error["message"], (extra, error)
    thread.join(120)
    assert len(streamed) > 100


def test_fields_that_change_nothing_are_accepted(client, model):
    completion = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}], max_tokens=3,
        response_format={"type": "text"}, extra_body={"modalities": ["text"], "tool_choice": "none",
                                                      "use_beam_search": False, "priority": 0, "length_penalty": 1.0})
    assert completion.choices[0].finish_reason == "length"


def test_vllm_stop_and_truncation_extras(client, model, tiny_llm):
    """stop_token_ids, include_stop_str_in_output and truncate_prompt_tokens do what vLLM's do, in
    both APIs (the reference: the same request offline, whose own tests pin these down)."""
    prompt = "The mill stood by the river and"
    greedy = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
    full = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0]
    ids = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    stop_id = ids[5]
    by_id = client.completions.create(**greedy, extra_body={"stop_token_ids": [stop_id]}).choices[0]
    assert by_id.finish_reason == "stop" and by_id.model_extra["stop_reason"] == stop_id
    assert full.text.startswith(by_id.text) and len(by_id.text) < len(full.text)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert stop.strip()
    cut = client.completions.create(**greedy, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = client.completions.create(**greedy, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert cut.text + stop == kept.text == full.text[:full.text.index(stop) + len(stop)]
    assert kept.finish_reason == "stop" and kept.model_extra["stop_reason"] == stop
    # truncate_prompt_tokens: the answer to the prompt's last 4 tokens, as if those were the prompt
    prompt_ids = tiny_llm.get_tokenizer()(prompt)["input_ids"]
    short = client.completions.create(**{**greedy, "prompt": prompt_ids[-4:]}, extra_body={"ignore_eos": True})
    truncated = client.completions.create(**greedy, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 4})
    assert truncated.usage.prompt_tokens == 4 and truncated.choices[0].text == short.choices[0].text
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_retrieve_model(client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert "does not exist" in caught.value.body["message"]


LOGLIKELIHOOD_PROMPT = "Question: what turns a water mill? Answer: the river"


def test_echo_logprobs_with_max_tokens_zero_is_lm_evals_loglikelihood(client, model, tiny_llm):
    (offline,) = tiny_llm.generate([LOGLIKELIHOOD_PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1),
                                   use_tqdm=False)
    ids = offline.prompt_token_ids
    completion = client.completions.create(model=model, prompt=LOGLIKELIHOOD_PROMPT, echo=True, logprobs=1,
                                           max_tokens=0, temperature=0)
    choice = completion.choices[0]
    assert choice.text == LOGLIKELIHOOD_PROMPT and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == LOGLIKELIHOOD_PROMPT
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [offline.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 1 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]
    assert completion.usage.completion_tokens == 0


def test_echo_logprobs_then_completion_streamed_and_not(client, model):
    kwargs = dict(model=model, prompt=LOGLIKELIHOOD_PROMPT, echo=True, logprobs=2, max_tokens=4, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    num_prompt = len(whole.logprobs.tokens) - 4
    assert whole.text.startswith(LOGLIKELIHOOD_PROMPT) and whole.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in whole.logprobs.token_logprobs[1:])
    assert whole.logprobs.text_offset[num_prompt] == len(LOGLIKELIHOOD_PROMPT)
    tokens, values, text = [], [], ""
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert text == whole.text and tokens == whole.logprobs.tokens
    assert values[0] is None and values[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)


def test_prompt_logprobs_extra_in_both_apis(client, model):
    completion = client.completions.create(model=model, prompt=LOGLIKELIHOOD_PROMPT, max_tokens=1,
                                           extra_body={"prompt_logprobs": 2})
    scored = completion.choices[0].model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) > 5
    assert all(len(entry) in (2, 3) and all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())
               for entry in scored[1:])
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    scored = chat.model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(entry) == 1 for entry in scored[1:])


def test_max_tokens_zero_needs_echo(client, model):
    with pytest.raises(openai.BadRequestError, match="needs echo"):
        client.completions.create(model=model, prompt="x", max_tokens=0)
