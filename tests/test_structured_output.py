"""Structured outputs: constraints compiled by llguidance, masks applied in the batched sampler.

A tiny random-weight model produces noise when unconstrained, so every output that validates
here validates because of the mask."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.structured_output import GrammarCompiler, token_bitmasks
from tokenmill.errors import InvalidParameterError
import tokenmill.layers.sampler as sampler
from tokenmill.layers.sampler import SamplingSpec, TokenBitmask, apply_token_bitmask_, sample
from tokenmill.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputsParams

VOCAB = 49152
BOUNDED_STRING = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": BOUNDED_STRING, "age": {"type": "integer", "minimum": 0,
                                                                      "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 4}}, "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
     "required": ["ok", "note"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "fixed"}, "n": {"type": "integer", "minimum": 1,
                                                                         "maximum": 3}},
     "required": ["kind", "n"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}},
                "required": ["a"], "additionalProperties": False},
               {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"],
                "additionalProperties": False}]},
    {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}, "label": BOUNDED_STRING},
        "required": ["id", "label"], "additionalProperties": False}}}, "required": ["rows"],
     "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}}, "required": ["v"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
     "required": ["left", "right"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256)


def _constrained(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 400, "temperature": 0.0, "structured_outputs": spec, **kwargs})


# ---- parameters and compiling ----------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "must be an object"),
    ({"regex": ""}, "non-empty string"),
    ({"choice": []}, "choice must be a list"),
    ({"choice": ["a", 3]}, "choice must be a list"),
    ({"grammar": "x" * (MAX_GRAMMAR_CHARS + 1)}, f"at most {MAX_GRAMMAR_CHARS}"),
])
def test_params_are_checked(kwargs, message):
    with pytest.raises(InvalidParameterError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"json": {"type": "foo"}}, "invalid JSON schema: Invalid type: foo"),
    ({"json": {"not": {"type": "string"}}}, 'Unimplemented keys: \\["not"\\]'),
    ({"json": {"type": "string", "format": "no-such-format"}}, "Unknown format"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "does not exist"),
    ({"json": {"type": "string", "pattern": "(("}}, "unclosed group"),
    ({"regex": "(("}, "invalid regular expression.*unclosed group"),
    ({"grammar": "start: foo"}, 'invalid grammar.*unknown name: "foo"'),
    ({"grammar": "start: ("}, "invalid grammar"),
])
def test_bad_constraints_are_invalid_parameters(compiler, kwargs, message):
    with pytest.raises(InvalidParameterError, match=message) as caught:
        compiler.compile(StructuredOutputsParams(**kwargs, param="response_format"))
    assert caught.value.param == "response_format" and caught.value.http_status == 400


def test_compiled_grammars_are_cached_by_text(compiler):
    first = compiler.compile(StructuredOutputsParams(json={"type": "object", "required": ["a"]}))
    same = compiler.compile(StructuredOutputsParams(json='{"required": ["a"], "type": "object"}'))
    other = compiler.compile(StructuredOutputsParams(json={"type": "object", "required": ["b"]}))
    assert same is first and other is not first


def test_cache_is_bounded(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, [tokenizer.eos_token_id], cache_size=2)
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{i}}}") for i in (1, 2, 3)]
    first = small.compile(specs[0])
    for spec in specs[1:]:
        small.compile(spec)
    assert len(small._cache) == 2 and small.compile(specs[0]) is not first


def test_bitmask_allows_exactly_the_grammars_tokens(compiler, tokenizer):
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).new_matcher()
    allowed = TokenBitmask([0], token_bitmasks([matcher])).allowed(VOCAB, torch.device("cpu"))[0]
    allowed_ids = allowed.nonzero().flatten().tolist()
    texts = {tokenizer.decode([t]) for t in allowed_ids}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed_ids
    assert tokenizer.eos_token_id not in allowed_ids  # nothing is complete yet


# ---- the sampler -------------------------------------------------------------------------------
def _mask_of(allowed: list[list[int]]) -> torch.Tensor:
    bitmask = torch.zeros(len(allowed), (VOCAB + 31) // 32, dtype=torch.int64)
    for row, ids in enumerate(allowed):
        for t in ids:
            bitmask[row, t // 32] |= 1 << (t % 32)
    return torch.where(bitmask >= 1 << 31, bitmask - (1 << 32), bitmask).to(torch.int32)  # the sign bit is token 31


def test_sampler_samples_only_allowed_tokens_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=1.0, seed=5)
    specs = [SamplingSpec(p, 11 + i, [1, 2], []) for i, p in enumerate([greedy, seeded, greedy, seeded])]
    allowed = [[31, 40_000, 49151], [7, 63, 64]]
    mask = TokenBitmask([0, 3], _mask_of(allowed))
    free = sample(logits, specs)
    masked = sample(logits, specs, mask)
    assert masked[0].token_id == max(allowed[0], key=lambda t: logits[0, t])
    assert masked[3].token_id in allowed[1]
    assert [masked[1].token_id, masked[2].token_id] == [free[1].token_id, free[2].token_id]


@pytest.mark.parametrize("vocab", [VOCAB, 1000, 33, 17])
def test_bitmask_kernel_equals_the_pytorch_path(monkeypatch, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-(1 << 31), 1 << 31, (3, (vocab + 31) // 32), dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -1  # a word with every token allowed
    bitmask[1, -1] = 0  # and one with none, at the tail
    mask = TokenBitmask([4, 0, 2], bitmask)
    by_kernel = logits.clone()
    apply_token_bitmask_(by_kernel, mask)
    monkeypatch.setattr(sampler, "_bitmask_kernel_available", lambda: False)
    by_torch = logits.clone()
    apply_token_bitmask_(by_torch, mask)
    assert torch.equal(by_kernel, by_torch)
    expected = logits.clone()
    for r, row in enumerate(mask.rows):
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    assert torch.equal(by_torch, expected)


# ---- end to end on the tiny model -----------------------------------------------------------
def test_every_schema_validates_greedy_and_sampled(llm):
    prompts = ["Describe it:", "JSON please"]
    params = [_constrained(StructuredOutputsParams(json=schema), temperature=t, seed=3)
              for schema in SCHEMAS for t in (0.0, 1.0)]
    outputs = llm.generate([prompts[i % 2] for i in range(len(params))], params, use_tqdm=False)
    for output, p in zip(outputs, params):
        sample_ = output.outputs[0]
        assert sample_.finish_reason == "stop", sample_.text
        jsonschema.validate(json.loads(sample_.text), p.structured_outputs.json)


def test_unconstrained_output_is_not_json(llm):
    (output,) = llm.generate(["Describe it:"], SamplingParams(max_tokens=20, temperature=0.0), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(output.outputs[0].text)


def test_json_object_is_an_object_or_a_valid_prefix_of_one(llm, compiler):
    # any object allows unbounded strings, which a random model never closes: it may run to the limit
    spec = StructuredOutputsParams(json_object=True)
    outputs = llm.generate(["a", "b"], [_constrained(spec, temperature=t, seed=8) for t in (0.0, 1.0)],
                           use_tqdm=False)
    for output in outputs:
        sample_ = output.outputs[0]
        assert sample_.text.startswith("{")
        if sample_.finish_reason == "stop":
            assert isinstance(json.loads(sample_.text), dict)
        else:
            matcher = compiler.compile(spec).new_matcher()
            assert all(matcher.accept(t) for t in sample_.token_ids)


def test_regex_choice_and_grammar(llm):
    regex = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    choices = ["alpha", "beta", "gamma delta"]
    params = [_constrained(StructuredOutputsParams(regex=regex), temperature=1.0, seed=1),
              _constrained(StructuredOutputsParams(choice=choices), temperature=1.0, seed=2),
              _constrained(StructuredOutputsParams(grammar='start: "(" NUM ("+" NUM)~1..3 ")"\nNUM: /[0-9]/'))]
    outputs = [o.outputs[0] for o in llm.generate(["a", "b", "c"], params, use_tqdm=False)]
    assert re.fullmatch(regex, outputs[0].text), outputs[0].text
    assert outputs[1].text in choices
    assert re.fullmatch(r"\([0-9](\+[0-9]){1,3}\)", outputs[2].text), outputs[2].text
    assert all(o.finish_reason == "stop" for o in outputs)


def test_batched_with_unconstrained_requests_changes_nothing_for_them(llm):
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=9, ignore_eos=True)
    alone = [llm.generate(["Plain one"], free, use_tqdm=False)[0].outputs[0].token_ids,
             llm.generate(["Plain two"], seeded, use_tqdm=False)[0].outputs[0].token_ids]
    constrained = _constrained(StructuredOutputsParams(json=SCHEMAS[0]))
    outputs = llm.generate(["Plain one", "JSON", "Plain two", "JSON too"], [free, constrained, seeded, constrained],
                           use_tqdm=False)
    assert [outputs[0].outputs[0].token_ids, outputs[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), SCHEMAS[0])


def test_max_tokens_cut_off_leaves_a_valid_prefix(llm, compiler):
    spec = StructuredOutputsParams(json=SCHEMAS[10])
    (output,) = llm.generate(["x"], _constrained(spec, max_tokens=6), use_tqdm=False)
    sample_ = output.outputs[0]
    assert sample_.finish_reason == "length" and len(sample_.token_ids) == 6
    matcher = compiler.compile(spec).new_matcher()
    assert all(matcher.accept(t) for t in sample_.token_ids)
    assert not matcher.is_terminated


def test_n_samples_each_follow_the_grammar(llm):
    params = _constrained(StructuredOutputsParams(json=SCHEMAS[2]), n=4, temperature=1.0, seed=4)
    (output,) = llm.generate(["many"], params, use_tqdm=False)
    texts = [c.text for c in output.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS[2])
    assert len(set(texts)) > 1  # really sampled, each on its own matcher


def test_constraints_survive_preemption_chunking_and_prefix_hits(tiny_llama_dir, llm):
    shared = "Once upon a time, in a kingdom by the sea, there lived a king who loved numbers. " * 2
    prompts = [shared + "First", shared + "Second", shared + "Third"]
    params = [_constrained(StructuredOutputsParams(json=SCHEMAS[i]), temperature=1.0, seed=i, max_tokens=100)
              for i in (3, 11, 11)]  # the longest outputs here: ~40 + ~60 tokens, up to 7 blocks each
    roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=11, max_num_batched_tokens=9)
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    assert tight.stats().kv_cache.prefix_cache_hits > 0
    assert [o.outputs[0].token_ids for o in outputs] == roomy
    assert tight.stats().kv_cache.num_used_blocks == 0


def test_stop_strings_end_a_constrained_output(llm):
    (free,) = llm.generate(["x"], _constrained(StructuredOutputsParams(json=SCHEMAS[0])), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    (stopped,) = llm.generate(["x"], _constrained(StructuredOutputsParams(json=SCHEMAS[0]), stop=[stop]),
                              use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert text.startswith(stopped.outputs[0].text) and stop not in stopped.outputs[0].text


def test_grammar_wins_over_min_tokens(llm, tokenizer):
    # the grammar allows one token, which is also a stop token banned until min_tokens: the grammar wins
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    params = _constrained(StructuredOutputsParams(regex="a"), stop_token_ids=[a], min_tokens=3, max_tokens=5)
    (output,) = llm.generate(["x"], params, use_tqdm=False)
    assert output.outputs[0].token_ids == [a] and output.outputs[0].finish_reason == "stop"
    free = _constrained(StructuredOutputsParams(regex="[a-z]+"), min_tokens=8, max_tokens=8, temperature=1.0, seed=1)
    (output,) = llm.generate(["x"], free, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 8  # where the grammar has a choice, min_tokens holds


def test_a_bad_constraint_fails_only_its_request(llm):
    with pytest.raises(InvalidParameterError, match="invalid regular expression"):
        llm.generate(["x"], _constrained(StructuredOutputsParams(regex="[")), use_tqdm=False)
    (output,) = llm.generate(["x"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_masks_do_not_pull_in_torch_compile(llm):
    # llguidance.torch imports torch._dynamo at import (~85 MB resident, ~2 s) for a helper we do not use
    import sys

    llm.generate(["x"], _constrained(StructuredOutputsParams(choice=["a", "b"])), use_tqdm=False)
    assert "llguidance.torch" not in sys.modules
