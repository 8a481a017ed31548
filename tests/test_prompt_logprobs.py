"""Prompt logprobs against transformers' log-softmax of the same prompt (tiny fp32 models): whole
prefills, chunked ones, after a prefix-cache hit, across preemption, with n > 1 and max_tokens 0."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog chases the fox around the old mill pond"
TOLERANCE = 1e-4
NUM_TOP = 5


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    """arch -> (prompt token ids, log-softmax [T, V]) from transformers."""
    result = {}
    for arch in ("llama", "qwen3"):
        llm_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dirs[arch]))
        ids = llm_tokenizer(PROMPT)["input_ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dirs[arch]), dtype=torch.float32)
        with torch.no_grad():
            result[arch] = ids, model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return result


def _check(prompt_logprobs, ids, logprobs) -> None:
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for position in range(1, len(ids)):
        entry, expected = prompt_logprobs[position], logprobs[position - 1]
        token = ids[position]
        assert entry[token].logprob == pytest.approx(expected[token].item(), abs=TOLERANCE)
        # the reference's rank, up to tokens within TOLERANCE of it (near-ties may fall either side)
        target = expected[token]
        assert int((expected > target + TOLERANCE).sum()) + 1 <= entry[token].rank \
            <= int((expected >= target - TOLERANCE).sum())
        top = expected.topk(NUM_TOP)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= NUM_TOP)
        assert [t for _, t in ranked] == top.indices.tolist()
        for t, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(value, abs=TOLERANCE)
        assert entry[token].decoded_token is not None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(tiny_model_dirs, reference, arch, budget):
    ids, logprobs = reference[arch]
    llm = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=budget)
    (output,) = llm.generate([ids], SamplingParams(max_tokens=3, prompt_logprobs=NUM_TOP), use_tqdm=False)
    _check(output.prompt_logprobs, ids, logprobs)
    assert len(output.outputs[0].token_ids) == 3


def test_prompt_logprobs_after_a_prefix_cache_hit(tiny_model_dirs, reference):
    ids, logprobs = reference["llama"]
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=64)
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)  # the prompt's blocks are cached now
    (again,) = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    assert again.num_cached_tokens > 0
    (output,) = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=NUM_TOP), use_tqdm=False)
    assert output.num_cached_tokens == 0  # every row it reports was computed
    _check(output.prompt_logprobs, ids, logprobs)


def test_max_tokens_zero_scores_the_prompt_only(tiny_model_dirs, reference):
    ids, logprobs = reference["llama"]
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=7)
    (output,) = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=NUM_TOP), use_tqdm=False)
    assert output.outputs[0].token_ids == [] and output.outputs[0].text == ""
    assert output.outputs[0].finish_reason == "length"
    _check(output.prompt_logprobs, ids, logprobs)
    assert llm.stats().kv_cache.num_used_blocks == 0


def test_n_samples_share_one_scoring_and_preemption_scores_nothing_twice(tiny_model_dirs, reference):
    ids, logprobs = reference["llama"]
    # 4 samples x ~30 + 40 tokens need more than 12 blocks at once: preemption
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=12, max_num_batched_tokens=9)
    params = SamplingParams(n=4, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True, prompt_logprobs=NUM_TOP)
    (output,) = llm.generate([ids], params, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    _check(output.prompt_logprobs, ids, logprobs)
    assert all(len(c.token_ids) == 40 for c in output.outputs)


def test_prompt_logprobs_are_checked():
    with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_preempted_mid_prompt_scores_nothing_twice(tiny_model_dirs, reference):
    ids, logprobs = reference["llama"]
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", num_kv_blocks=12, max_num_batched_tokens=4)
    engine = llm.engine
    engine.add_request("long", list(range(10, 110)), SamplingParams(max_tokens=85, ignore_eos=True))
    while engine.scheduler.requests["long"].num_tokens < 155:  # 10 of the 12 blocks
        engine.step()
    engine.add_request("scored", ids, SamplingParams(max_tokens=2, prompt_logprobs=NUM_TOP))
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    scored = outputs["scored"]
    assert scored.metrics.num_preemptions > 0  # it lost its blocks half-way through its prompt
    _check(scored.prompt_logprobs, ids, logprobs)
