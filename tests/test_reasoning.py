"""The reasoning parsers: whole replies split at </think>, and streams split the same way however
the text is cut into pieces."""

from __future__ import annotations

import random

import pytest

from tokenmill.server.reasoning import REASONING_PARSERS, ReasoningStream

REPLIES = [
    "<think>\nLet me think.\nOK  </think>\n\nThe answer is 4.", "The answer, no thinking.", "  <think>a</think>b",
    "<think>cut off mid thought", "<thi", "<think></think>\n\nx", "Why</think>\nSo.", "<th is not a tag", "",
    "<think>a < b and </thin is not the end</think>done <think> stays",
]


@pytest.mark.parametrize("reply, qwen3, deepseek_r1", [
    (REPLIES[0], ("Let me think.\nOK", "The answer is 4."), ("Let me think.\nOK", "The answer is 4.")),
    (REPLIES[1], (None, REPLIES[1]), (REPLIES[1], "")),
    (REPLIES[3], ("cut off mid thought", ""), ("cut off mid thought", "")),
    (REPLIES[5], (None, "x"), (None, "x")),
    (REPLIES[6], (None, REPLIES[6]), ("Why", "So.")),
])
def test_split(reply, qwen3, deepseek_r1):
    assert REASONING_PARSERS["qwen3"].split(reply) == qwen3
    assert REASONING_PARSERS["deepseek_r1"].split(reply) == deepseek_r1


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("reply", REPLIES)
def test_a_stream_splits_as_the_whole_reply(name, reply):
    parser = REASONING_PARSERS[name]
    rng = random.Random(len(reply))
    for _ in range(30):
        stream, reasoning, content, start = ReasoningStream(parser), "", "", 0
        while start < len(reply):
            end = min(len(reply), start + rng.randint(1, 5))
            r, c = stream.feed(reply[start:end], finished=False)
            reasoning, content, start = reasoning + r, content + c, end
        r, c = stream.feed("", finished=True)
        assert (reasoning + r or None, content + c) == parser.split(reply)


def test_a_constrained_reply_is_reasoning_only_where_it_opens_the_block():
    # deepseek_r1's block is opened by the template, but a grammar applies from the first token: a
    # constrained reply is content unless it writes <think> itself
    from types import SimpleNamespace

    from tokenmill.server.protocol import ChatCompletionRequest
    from tokenmill.server.serving_chat import _tool_plan

    ctx = SimpleNamespace(reasoning_parser=REASONING_PARSERS["deepseek_r1"], tool_parser=None)
    for extra, reply, expected in [
        ({"structured_outputs": {"json": {"type": "object"}}}, '{"a": 1}', (None, '{"a": 1}')),
        ({"structured_outputs": {"regex": "<think>x</think>y"}}, "<think>x</think>y", ("x", "y")),
        ({}, "hmm</think>answer", ("hmm", "answer")),
    ]:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}], **extra)
        plan, _ = _tool_plan(ctx, body, body.sampling_params(10, None, 100))
        message, _ = plan.message(reply, "stop")
        assert (message["reasoning_content"], message["content"]) == expected
