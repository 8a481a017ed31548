"""Sampler and SamplingParams: greedy, filters, penalties, seeds, logprobs, validation."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.errors import InvalidParameterError, TokenmillError
from tokenmill.engine.scheduler_output import SamplingRequest
from tokenmill.layers.sampler import SamplingSpec, gumbel_noise, sample, uniform_from_bits
from tokenmill.worker.model_runner import sampling_spec


def spec(params: SamplingParams, seed: int = 0, output: list[int] | None = None, prompt=None, banned=None):
    return SamplingSpec(params, seed, prompt or [], output or [], banned or [])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1}, {"temperature": 2.5}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"top_k": 0},
        {"n": 0}, {"n": 17}, {"min_p": 1.5}, {"max_tokens": -1}, {"logprobs": 21}, {"repetition_penalty": 0.0},
        {"presence_penalty": 3.0}, {"frequency_penalty": -2.5}, {"min_tokens": 5, "max_tokens": 2},
        {"stop": [""]}, {"stop": ["x"] * 17}, {"logit_bias": {1: 200.0}},
    ],
)
def test_invalid_parameters_raise_typed_error(kwargs):
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, TokenmillError) and info.value.http_status == 400
    assert info.value.param is not None and info.value.param.split("_")[0] in str(info.value)


def test_greedy_and_top_k_1_pick_argmax():
    logits = torch.randn(6, 100)
    greedy = sample(logits.clone(), [spec(SamplingParams(temperature=0))] * 6)
    top1 = sample(logits.clone(), [spec(SamplingParams(temperature=1.0, top_k=1), seed=s) for s in range(6)])
    assert [t.token_id for t in greedy] == logits.argmax(-1).tolist() == [t.token_id for t in top1]


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = [0, 0, 0, 0]
    for seed in range(4000):
        counts[sample(logits.clone(), [spec(SamplingParams(temperature=1.0), seed=seed)])[0].token_id] += 1
    for observed, p in zip(counts, [0.5, 0.3, 0.15, 0.05]):
        assert abs(observed / 4000 - p) < 4 * math.sqrt(p * (1 - p) / 4000)


def test_top_p_min_p_and_top_k_exclude_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for params, allowed in [
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(top_p=0.5), {0}),
        (SamplingParams(min_p=0.35), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
    ]:
        seen = {sample(logits.clone(), [spec(params, seed=s)])[0].token_id for s in range(300)}
        assert seen == allowed, params


def test_seed_gives_same_tokens_whatever_the_batch():
    logits = torch.randn(1, 500)
    alone = sample(logits.clone(), [spec(SamplingParams(temperature=1.0), seed=77, output=[1, 2])])[0].token_id
    batch = torch.cat([torch.randn(3, 500), logits, torch.randn(2, 500)])
    specs = [spec(SamplingParams(temperature=0.7), seed=s) for s in range(3)]
    specs += [spec(SamplingParams(temperature=1.0), seed=77, output=[1, 2])]
    specs += [spec(SamplingParams(temperature=0))] * 2
    assert sample(batch, specs)[3].token_id == alone


def test_uniforms_stay_inside_the_open_interval_so_noise_is_finite():
    bits = torch.tensor([0, 1, 0xFFFFFF00, 0xFFFFFFFE, 0xFFFFFFFF], dtype=torch.int64)
    uniform = uniform_from_bits(bits)
    assert bool((uniform > 0).all()) and bool((uniform < 1).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(uniform))).all())
    noise = gumbel_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 1 << 16)  # 4M draws
    assert bool(torch.isfinite(noise).all())


def test_gumbel_noise_is_a_function_of_seed_and_counter():
    a = gumbel_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 1000)
    b = gumbel_noise(torch.tensor([6]), torch.tensor([0]), 1000)
    c = gumbel_noise(torch.tensor([6]), torch.tensor([1]), 1000)
    assert torch.equal(a[1], b[0]) and not torch.equal(b, c) and not torch.equal(a[0], a[1])
    assert torch.isfinite(a).all() and abs(a.mean().item() - 0.5772) < 0.1  # Euler-Mascheroni


def test_penalties_and_logit_bias():
    logits = torch.tensor([[2.0, 1.9, 1.0, -1.0]])
    freq = spec(SamplingParams(temperature=0, frequency_penalty=0.1), output=[0, 0])
    assert sample(logits.clone(), [freq])[0].token_id == 1
    presence = spec(SamplingParams(temperature=0, presence_penalty=0.2), output=[0])
    assert sample(logits.clone(), [presence])[0].token_id == 1
    repetition = spec(SamplingParams(temperature=0, repetition_penalty=1.1), prompt=[0])
    assert sample(logits.clone(), [repetition])[0].token_id == 1  # 2.0 / 1.1 < 1.9
    bias = spec(SamplingParams(temperature=0, logit_bias={3: 5.0}))
    assert sample(logits.clone(), [bias])[0].token_id == 3


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0, min_tokens=2)
    # token 0 ends the sequence: never as its first or second token, as its third
    specs = [sampling_spec(SamplingRequest(params, 0, [7], [1] * n, frozenset({0}))) for n in range(3)]
    assert [s.banned_token_ids for s in specs] == [[0], [0], []]
    assert [t.token_id for t in sample(logits.repeat(3, 1), specs)] == [1, 1, 0]


def test_logprobs_chosen_and_top_k():
    logits = torch.randn(2, 50)
    result = sample(logits.clone(), [spec(SamplingParams(temperature=0, logprobs=5)), spec(SamplingParams(temperature=0))])
    ref = logits.log_softmax(-1)
    first = result[0]
    assert first.rank == 1 and abs(first.logprob - ref[0].max().item()) < 1e-5
    assert [t for t, _ in first.top_logprobs] == ref[0].topk(5).indices.tolist()
    assert result[1].top_logprobs is None and result[1].logprob is None


def test_seeded_generation_is_reproducible_across_batch_mixes(tiny_llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = tiny_llm.generate(["Tell me a story"], params, use_tqdm=False)[0].outputs[0].token_ids
    mixed = tiny_llm.generate(
        ["Other prompt one", "Tell me a story", "A third, longer prompt about something else entirely"],
        [SamplingParams(temperature=0.8, max_tokens=7), params, SamplingParams(temperature=0, max_tokens=20)],
        use_tqdm=False,
    )[1].outputs[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12, ignore_eos=True)
    assert tiny_llm.generate(["Tell me a story"], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
