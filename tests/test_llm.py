"""The offline API: prompt forms, n, stop strings, logprobs, timings, chat, errors."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams, TokensPrompt, __version__
from tokenmill.errors import InvalidParameterError, RequestTooLongError


def test_prompt_forms_and_output_shape(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    text = tiny_llm.generate("Hello there", params, use_tqdm=False)
    ids = tiny_llm.get_tokenizer()("Hello there")["input_ids"]
    by_ids = tiny_llm.generate(ids, params, use_tqdm=False)
    batch = tiny_llm.generate(["Hello there", ids], params, use_tqdm=False)
    assert len(text) == len(by_ids) == 1 and len(batch) == 2
    out = text[0]
    assert out.prompt == "Hello there" and out.prompt_token_ids == ids and out.finished
    completion = out.outputs[0]
    assert len(completion.token_ids) == 5 and completion.finish_reason == "length"
    assert completion.text == tiny_llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    assert by_ids[0].outputs[0].token_ids == completion.token_ids == batch[1].outputs[0].token_ids
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert __version__


def test_vllm_prompt_dicts(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = tiny_llm.get_tokenizer()("Hello there")["input_ids"]
    bare = tiny_llm.generate(["Hello there", ids], params, use_tqdm=False)
    dicts = tiny_llm.generate([{"prompt": "Hello there"}, TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in bare]
    assert dicts[0].prompt == "Hello there" and dicts[1].prompt is None and dicts[1].prompt_token_ids == ids
    one = tiny_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert len(one) == 1 and one[0].outputs[0].token_ids == bare[1].outputs[0].token_ids
    for bad, message in (({"text": "x"}, "exactly one of 'prompt'"), ({"prompt": "x", "prompt_token_ids": [1]}, "not"),
                         ({"prompt_token_ids": ["a"]}, "list of token ids"), (3.5, "not float"),
                         ({"prompt": "x", "multi_modal_data": {}}, "text only")):
        with pytest.raises(InvalidParameterError, match=message):
            tiny_llm.generate(["fine", bad], params, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_outputs_in_prompt_order_with_per_prompt_params(tiny_llm):
    prompts = ["a b c", "d e f g h", "i"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 2, 4)]
    outputs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [7, 2, 4]
    assert [o.prompt for o in outputs] == prompts


def test_n_parallel_samples(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    out = tiny_llm.generate("The prompt is long enough to fill at least one KV block of sixteen tokens", params,
                            use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    assert tiny_llm.stats().kv_cache.num_used_blocks == 0


def test_stop_strings_and_stop_token_ids(tiny_llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = tiny_llm.generate("Count with me", base, use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    cut = tiny_llm.generate(
        "Count with me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)] and stop not in cut.text
    token = full.token_ids[3]
    by_id = tiny_llm.generate(
        "Count with me", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[token]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == token
    assert by_id.token_ids == full.token_ids[: full.token_ids.index(token) + 1]
    kept = tiny_llm.generate("Count with me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                             include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == cut.text + stop and kept[0].outputs[0].stop_reason == stop


def test_logprobs(tiny_llm):
    out = tiny_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4, logprobs=3), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert entry[token_id].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and all(lp.logprob <= 0 and lp.decoded_token is not None for lp in entry.values())


def test_invalid_requests_raise_and_leave_nothing_queued(tiny_llm):
    with pytest.raises(RequestTooLongError, match="exceeds max_model_len"):
        tiny_llm.generate(["fine", "too long"], SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="empty"):
        tiny_llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="token ids"):
        tiny_llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="2 SamplingParams for 1 prompts"):
        tiny_llm.generate(["x"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_chat_applies_template(tiny_llm):
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Bye"}]]
    outputs = tiny_llm.chat(conversations, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(outputs) == 2
    assert "<|im_start|>user\nHi<|im_end|>" in outputs[0].prompt
    assert outputs[0].prompt.endswith("<|im_start|>assistant\n")


THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_arguments(tiny_llm):
    """vLLM's LLM.chat arguments: another template, variables for it, going on with the last message."""
    chat = [{"role": "user", "content": "Hi"}]
    plain = tiny_llm.apply_chat_template(chat, chat_template=THINKING_TEMPLATE)
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = tiny_llm.chat(chat, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                        chat_template=THINKING_TEMPLATE, chat_template_kwargs={"enable_thinking": False})
    assert off[0].prompt == plain + "<think></think>"
    going_on = chat + [{"role": "assistant", "content": "Hello, I am"}]
    text = tiny_llm.apply_chat_template(going_on, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(InvalidParameterError, match="cannot both be true"):
        tiny_llm.chat(going_on, continue_final_message=True, use_tqdm=False)
    for kwargs, name in (({"messages": []}, "'messages'"), ({"tokenize": True}, "'tokenize'"), ({"1x": 1}, "not a name")):
        with pytest.raises(InvalidParameterError, match=name) as caught:
            tiny_llm.chat(chat, chat_template_kwargs=kwargs, use_tqdm=False)
        assert caught.value.param == "chat_template_kwargs"
    assert not tiny_llm.engine.has_unfinished_requests()


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    engine.add_request("to-abort", "Some prompt to start generating from", SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().kv_cache.num_used_blocks > 0
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.stats().kv_cache.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_bad_engine_arguments(tiny_llama_dir):
    with pytest.raises(InvalidParameterError, match="dtype"):
        LLM(model=str(tiny_llama_dir), dtype="float64")
    with pytest.raises(InvalidParameterError, match="smaller than one KV block"):
        LLM(model=str(tiny_llama_dir), kv_cache_memory=10)
    with pytest.raises(InvalidParameterError, match="fraction"):
        LLM(model=str(tiny_llama_dir), kv_cache_memory=1.5)
    with pytest.raises(InvalidParameterError, match="kv_cache_dtype must be one of"):
        LLM(model=str(tiny_llama_dir), kv_cache_dtype="fp8")
    with pytest.raises(InvalidParameterError, match="needs a float32 model"):
        LLM(model=str(tiny_llama_dir), dtype="bfloat16", kv_cache_dtype="float16")


def test_kv_cache_memory_budget_sets_pool_size(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=3_000_000)
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # (K, V) x 2 layers x 2 KV heads x head_dim 16 x 4 bytes x 16 tokens
    assert llm.stats().kv_cache.num_blocks == 3_000_000 // per_block
    by_fraction = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=0.001)
    assert by_fraction.stats().kv_cache.num_blocks > 0
    half = LLM(model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=3_000_000, kv_cache_dtype="float16")
    assert half.stats().kv_cache.num_blocks == 3_000_000 // (per_block // 2)  # a 16-bit pool: twice the blocks
    assert half.engine.executor.runner.kv_cache.dtype == torch.float16


def test_kv_cache_dtype_auto(tiny_llama_dir):
    """auto: the model's dtype, but float16 under a float32 model that dtype auto chose because the
    CPU has no native bf16 (what llama.cpp keeps), where decode reads such a pool in one kernel;
    an explicit float32 model keeps float32."""
    from tokenmill.layers.attention import narrow_pool_reads_in_one_kernel
    from tokenmill.platform import cpu_has_native_bf16, resolve_kv_cache_dtype

    auto = LLM(model=str(tiny_llama_dir), num_kv_blocks=8)
    if cpu_has_native_bf16():
        expected = torch.bfloat16
    else:
        expected = torch.float16 if narrow_pool_reads_in_one_kernel(torch.device("cpu")) else torch.float32
    assert auto.engine.executor.runner.kv_cache.dtype == expected
    explicit = LLM(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=8)
    assert explicit.engine.executor.runner.kv_cache.dtype == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.float32, auto_float16=True) == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, auto_float16=True) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, auto_float16=True) == torch.bfloat16


def test_kv_waste_stays_small_and_blocks_return(tiny_llm):
    engine = tiny_llm.engine
    words = "paged attention keeps the key value cache in fixed size blocks of sixteen tokens each".split()
    for i in range(6):  # distinct ~250-token prompts: no shared prefix blocks
        prompt = " ".join(words[(i + j * 7) % len(words)] + str(j % (i + 3)) for j in range(110))
        engine.add_request(f"waste-{i}", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(12):
        engine.step()
    stats = engine.stats().kv_cache
    assert stats.num_tokens_stored > 6 * 200
    assert stats.waste < 0.04  # only each sequence's last block is partly empty
    engine.abort_request("waste-2")
    engine.kv_cache.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache.check_integrity()
    assert engine.stats().kv_cache.num_used_blocks == 0


def test_min_tokens_defers_stop_strings(tiny_llm):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = tiny_llm.generate("Count with me", base, use_tqdm=False)[0].outputs[0]
    tokenizer = tiny_llm.get_tokenizer()
    stop = full.text[4:7]
    assert stop.strip() and full.text.count(stop) == 1
    # the token that completes the stop string
    completes = next(i for i in range(1, 21) if stop in tokenizer.decode(full.token_ids[:i]))
    stopped = tiny_llm.generate("Count with me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                stop=[stop], min_tokens=completes - 1),
                                use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.text == full.text[: full.text.index(stop)]
    deferred = tiny_llm.generate("Count with me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                 stop=[stop], min_tokens=completes),
                                 use_tqdm=False)[0].outputs[0]
    assert deferred.finish_reason == "length" and deferred.text == full.text  # the only match came too early


def test_a_failed_step_leaves_no_hash_of_unwritten_blocks(tiny_llm, monkeypatch):
    engine = tiny_llm.engine
    prompt = engine.tokenize("a prompt long enough to fill several KV blocks of sixteen tokens each " * 3)
    real_execute = engine.executor.execute

    def execute(scheduler_output):  # the forward writes some K/V, then fails
        real_execute(scheduler_output)
        raise RuntimeError("failed after writing")

    monkeypatch.setattr(engine.executor, "execute", execute)
    cached_before = set(engine.kv_cache.pool.cached)
    engine.add_request("doomed", prompt, SamplingParams(max_tokens=4))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].error is not None and outputs[-1].outputs[0].finish_reason == "error"
    assert set(engine.kv_cache.pool.cached) <= cached_before  # nothing of the failed step was registered
    monkeypatch.undo()
    again = tiny_llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].finish_reason == "length"
    engine.kv_cache.check_integrity()
