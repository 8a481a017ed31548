"""Our model code vs HF transformers on tiny random Llama / Mistral / Qwen2 / Qwen3 models."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention import AttentionContext, CacheGeometry, TorchPagedAttention
from tokenmill.models.loader import load_model

from conftest import TINY_ARCHS

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms "
    "and an oozy smell, nor yet a dry, bare, sandy hole with nothing in it to sit down on or to eat: "
    "it was a hobbit-hole, and that means comfort.",
    "1, 2, 3, 4, 5,",
]


def _hf_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _our_logits(loaded, prompts_ids: list[list[int]], split: int | None = None) -> list[torch.Tensor]:
    """Logits of every prompt token, computed as one ragged batch through the paged cache.

    With split, each prompt is fed in two chunks (the second attends to the cached first).
    """
    config, block_size = loaded.config, 16
    blocks_per_seq = max(len(p) for p in prompts_ids) // block_size + 1
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(prompts_ids))]
    dtype = loaded.model.norm.weight.dtype
    num_blocks = blocks_per_seq * len(prompts_ids)
    kv = torch.zeros(config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size,
                     config.head_dim, dtype=dtype)
    kv_caches = [(layer[0], layer[1]) for layer in kv]
    chunks = [[(0, p)] if split is None else [(0, p[:split]), (split, p[split:])] for p in prompts_ids]
    per_prompt: list[list[torch.Tensor]] = [[] for _ in prompts_ids]
    for round_ in range(len(chunks[0])):
        batch = [chunks[i][round_] for i in range(len(prompts_ids))]
        backend = TorchPagedAttention()
        metadata = backend.build_metadata(
            query_lens=[len(ids) for _, ids in batch], context_lens=[start for start, _ in batch],
            block_tables=tables,
            geometry=CacheGeometry(block_size, num_blocks, config.num_key_value_heads, config.num_query_groups,
                                   config.head_dim, dtype, torch.device("cpu")),
        )
        ctx = AttentionContext(backend, metadata, kv_caches)
        with torch.inference_mode():
            input_ids = torch.tensor([t for _, ids in batch for t in ids])
            logits = loaded.model.compute_logits(loaded.model(input_ids, metadata.positions, ctx))
        offset = 0
        for i, (_, ids) in enumerate(batch):
            per_prompt[i].append(logits[offset : offset + len(ids)])
            offset += len(ids)
    return [torch.cat(parts) for parts in per_prompt]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_transformers(arch, tiny_model_dirs, tokenizer):
    path = tiny_model_dirs[arch]
    hf = _hf_model(path)
    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    assert loaded.config.architecture == arch
    prompts_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    ours_whole = _our_logits(loaded, prompts_ids)
    ours_chunked = _our_logits(loaded, [p * 3 for p in prompts_ids], split=len(prompts_ids[1]))
    for ids, whole, chunked in zip(prompts_ids, ours_whole, ours_chunked):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
            ref_long = hf(torch.tensor([ids * 3])).logits[0]
        assert (whole - ref).abs().max().item() <= 1e-4
        assert (chunked - ref_long).abs().max().item() <= 1e-4
        assert ref.std() > 0.5  # the logits are not trivially flat


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers_generate(arch, tiny_model_dirs, tokenizer):
    path = tiny_model_dirs[arch]
    hf = _hf_model(path)
    hf.generation_config.eos_token_id = None
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                          pad_token_id=0)[0, ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == ref
        assert output.outputs[0].finish_reason == "length"


def test_tied_and_untied_embeddings(tiny_model_dirs):
    llama = load_model(str(tiny_model_dirs["llama"]), torch.float32, torch.device("cpu"))
    qwen2 = load_model(str(tiny_model_dirs["qwen2"]), torch.float32, torch.device("cpu"))
    assert llama.model.lm_head is not None and not llama.config.tie_word_embeddings
    assert qwen2.model.lm_head is None and qwen2.config.tie_word_embeddings


def test_bfloat16_close_to_float32(tiny_llama_dir, tokenizer):
    ids = [tokenizer(PROMPTS[2])["input_ids"]]
    fp32 = _our_logits(load_model(str(tiny_llama_dir), torch.float32, torch.device("cpu")), ids)[0]
    bf16 = _our_logits(load_model(str(tiny_llama_dir), torch.bfloat16, torch.device("cpu")), ids)[0]
    assert bf16.dtype == torch.float32
    # bf16 keeps ~3 significant digits; the ranking of the top token should mostly survive
    agree = (bf16.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree > 0.8
