"""`tokenmill serve` on the default model, driven by the official openai SDK; the offline
engine on the same weights is the reference."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field
from server_harness import start_server

from tokenmill import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three parts of a water mill are"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory", str(256 << 20)],
                           tmp_path_factory.mktemp("default-server"))
    yield process
    assert process.metric("tokenmill:kv_cache_usage_perc") == 0.0
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


def _join_completion_stream(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    return texts, finish, usage


def test_completion_stream_equals_non_stream_and_offline(client, default_llm, tokenizer):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    texts, finish, usage = _join_completion_stream(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    offline = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert full.choices[0].text == texts[0] == offline.text
    assert full.choices[0].finish_reason == finish[0] == offline.finish_reason
    num_prompt = len(tokenizer(PROMPT)["input_ids"])
    for u in (full.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens) == (num_prompt, len(offline.token_ids))
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_prompt_forms(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    other = "Flour is made by"
    by_text = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=[ids, tokenizer(other)["input_ids"]], max_tokens=8,
                                       temperature=0)
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert [c.index for c in by_text.choices] == [0, 1]
    assert [c.text for c in by_text.choices] == [c.text for c in by_ids.choices]
    assert single.choices[0].text == by_text.choices[0].text
    assert by_text.usage.completion_tokens == 16


def test_chat_stream_equals_non_stream_and_offline(client, default_llm, tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
    ]
    plain = [messages[0], {"role": "user", "content": "Say hello."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    offline = default_llm.chat(plain, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert full.choices[0].message.content == streamed == offline.text
    assert full.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert full.choices[0].finish_reason == "stop" == offline.finish_reason
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert full.usage.completion_tokens == len(offline.token_ids)  # the end-of-turn token counts
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices


def test_n_samples_and_seed_reproducibility(client):
    def sample(seed, stream=False):
        kwargs = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=16, temperature=1.0, seed=seed)
        if stream:
            return _join_completion_stream(client.completions.create(**kwargs, stream=True))[0]
        return {c.index: c.text for c in client.completions.create(**kwargs).choices}

    first = sample(7)
    assert sorted(first) == [0, 1] and first[0] != first[1]
    assert sample(7) == first == sample(7, stream=True)
    assert sample(8) != first
    chat = [{"role": "user", "content": "Name a grain."}]
    replies = [
        [c.message.content for c in client.chat.completions.create(
            model=MODEL, messages=chat, n=2, max_tokens=12, temperature=1.0, seed=3).choices]
        for _ in range(2)
    ]
    assert replies[0] == replies[1] and len(replies[0]) == 2


def test_completion_logprobs_match_offline(client, default_llm):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    offline = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, logprobs=3),
                                   use_tqdm=False)[0].outputs[0]
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens == 8
    assert "".join(logprobs.tokens) == result.choices[0].text
    for token_id, token_lp, top, entry in zip(offline.token_ids, logprobs.token_logprobs, logprobs.top_logprobs,
                                              offline.logprobs):
        assert token_lp == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert len(top) == 3 and max(top.values()) == pytest.approx(token_lp, abs=1e-6)  # greedy = most likely
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a millstone."}], max_tokens=10,
                  temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 10
    assert "".join(entry.token for entry in content) == full.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.logprob <= 0 and bytes(entry.bytes).decode() == entry.token
    streamed = [e for c in client.chat.completions.create(**kwargs, stream=True) if c.choices
                for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert [e.token for e in streamed] == [e.token for e in content]
    # the second run reuses cached prompt blocks, so its numbers may differ in the last float bits
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)


def test_echo(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = _join_completion_stream(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True))[0]
    assert streamed[0] == PROMPT + plain


def test_stop_strings(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0).choices[0].text
    stop = free.split()[3]  # a word from the middle of the greedy answer
    cut = free[: free.index(stop)]
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop])
    assert result.choices[0].text == cut and result.choices[0].finish_reason == "stop"
    texts, finish, _ = _join_completion_stream(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop, stream=True))
    assert texts[0] == cut and finish[0] == "stop"


def test_errors_surface_as_sdk_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="1024"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3,
                                       stream=True)
    assert [m.id for m in client.models.list().data] == [MODEL]


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    population_millions: float = Field(ge=0, le=2000)


def test_sdk_parse_on_the_default_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=120, response_format=Capital,
        messages=[{"role": "user", "content": "Give the capital of France and its population as JSON."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital)
    assert "paris" in choice.message.parsed.capital.lower()


def test_json_object_on_the_default_model(client):
    completion = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=200, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with a name and a colour."}])
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)
