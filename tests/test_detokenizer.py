"""Incremental detokenization: multibyte text, and stop strings split across tokens."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Héllo wörld — naïve café, 你好世界, こんにちは, 🎉🚀 emoji 👩‍👩‍👧 and Ελληνικά.",
    "Plain ASCII text with  double  spaces and\nnewlines\n\n  indented.",
    "数学是科学的皇后。😀😃😄 Ünïcödé",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Say:")["input_ids"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add_token(t, flush=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


def test_multibyte_tokens_really_split(tokenizer):
    # the test above is only meaningful if some characters span several tokens
    ids = tokenizer("🎉🚀", add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)


@pytest.mark.parametrize("stop", ["STOP", " world", "d. S", "。"])
def test_stop_string_split_across_tokens(tokenizer, stop):
    text = "Hello world. STOP here。 and more text after it"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    emitted = ""
    for t in ids:
        emitted += detok.add_token(t)
        assert stop not in emitted
        if detok.stop_string is not None:
            break
    emitted += detok.finish()
    assert detok.stop_string == stop
    assert emitted == text[: text.index(stop)]


def test_stop_string_held_back_then_released(tokenizer):
    text = "abc ST abc"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    emitted, saw_partial_stop = "", False
    for i, token in enumerate(ids):
        emitted += detok.add_token(token)
        decoded = tokenizer.decode(ids[: i + 1])
        # the last len("STOP") - 1 characters wait: they could be the start of "STOP"
        assert emitted == decoded[: max(0, len(decoded) - 3)]
        if decoded.endswith("ST"):
            saw_partial_stop = True
            assert not emitted.endswith("ST")
    assert saw_partial_stop
    assert detok.finish() == text[len(emitted):]  # released at the end: nothing matched
    assert detok.stop_string is None


def test_stop_strings_wait_for_min_tokens(tokenizer):
    text = "one two one two three"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    two_at = next(i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("two"))
    # a stop string completed within the first min_tokens tokens does not count; the next one does
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["two"], min_tokens=two_at + 1))
    emitted = "".join(detok.add_token(t) for t in ids) + detok.finish()
    assert detok.stop_string == "two" and emitted == "one two one "
    early = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["two"], min_tokens=two_at))
    assert "".join(early.add_token(t) for t in ids) + early.finish() == "one "


def test_earliest_stop_string_wins(tokenizer):
    ids = tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["four", "two"]))
    emitted = "".join(detok.add_token(t) for t in ids) + detok.finish()
    assert emitted == "one " and detok.stop_string == "two"
