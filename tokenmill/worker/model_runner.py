"""ModelRunner: the only place a step becomes tensors, logits and sampled tokens."""

from __future__ import annotations

import math
import mmap

import torch

from tokenmill.engine.scheduler_output import PromptLogprobsRequest, SamplingRequest, SchedulerOutput
from tokenmill.layers.attention import (
    AttentionBackend, AttentionContext, CacheGeometry, TorchPagedAttention, narrow_pool_reads_in_one_kernel,
)
from tokenmill.layers.cpu_attention import default_attention_backend
from tokenmill.layers.sampler import SamplingSpec, TokenBitmask, sample, scored_tokens
from tokenmill.models.decode_plan import DecodePlan
from tokenmill.models.llama import DecoderForCausalLM
from tokenmill.outputs import ModelRunnerOutput, SampledToken
from tokenmill.platform import resolve_kv_cache_dtype
from tokenmill.worker.decode_graphs import DecodeGraphs
from tokenmill.worker.forward_input import ForwardInput


def pool_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device, dtype_was_auto: bool) -> torch.dtype:
    """The KV pool's dtype for a --kv-cache-dtype (platform.resolve_kv_cache_dtype): "auto" keeps
    float16 under a float32 model whose dtype "auto" chose, where decode reads such a pool in one
    kernel (the AVX2 build's)."""
    return resolve_kv_cache_dtype(kv_cache_dtype, dtype,
                                  auto_float16=dtype_was_auto and narrow_pool_reads_in_one_kernel(device))


class ModelRunner:
    """Holds the model and the KV cache tensors; runs one forward + sampling per step."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: AttentionBackend | None = None,
        decode_graphs: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """decode_graphs: pure decode steps replay CUDA graphs (worker/decode_graphs.py); the cache
        then gets one block more than the pool's num_blocks, the padding rows' scratch block.
        kv_cache_dtype: what the pool holds (None: dtype); a 16-bit pool under a float32 model is
        read by the PyTorch backend (platform.resolve_kv_cache_dtype)."""
        kv_cache_dtype = kv_cache_dtype or dtype
        config = model.config
        scratch_block = num_blocks
        num_blocks += 1 if decode_graphs else 0
        self.model = model
        self.device = device
        self.geometry = CacheGeometry(
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_heads=config.num_key_value_heads,
            num_query_groups=config.num_query_groups,
            head_dim=config.head_dim,
            dtype=dtype,
            device=device,
        )
        if backend is None and (decode_graphs or kv_cache_dtype != dtype):
            # the padded decode steps read keys in its row layout; the CPU kernels' own layout
            # wants the model's dtype
            backend = TorchPagedAttention()
        self.backend = backend or default_attention_backend(device, dtype, config.head_dim, config.num_query_groups)
        # [layers, 2 (K, V), kv_heads, num_blocks, block_size, head_dim]; zeroed so that unwritten
        # slots gathered with a block are finite (masked, but NaN * 0 would still poison softmax).
        shape = (config.num_hidden_layers, 2, config.num_key_value_heads, num_blocks, block_size, config.head_dim)
        self.kv_cache = zeros_on_demand(shape, kv_cache_dtype) if device.type == "cpu" else torch.zeros(
            shape, dtype=kv_cache_dtype, device=device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        # few-row decode steps skip the modules' per-call Python (models/decode_plan.py)
        # (CPU steps only: on a GPU whose host has the AVX2 build, the PyTorch backend is CUDA's)
        uses_plan = device.type == "cpu" and DecodePlan.applies(self.backend)
        self.decode_plan = DecodePlan(model, self.kv_caches) if uses_plan else None
        self.decode_graphs = DecodeGraphs(model, self.kv_caches, self.geometry, scratch_block) if decode_graphs else None

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: one sampled token per sequence that samples, in order, and prompt logprobs."""
        return self.sample(scheduler_output, self.forward(ForwardInput.from_scheduler_output(scheduler_output)))

    @torch.inference_mode()
    def forward(self, batch: ForwardInput) -> torch.Tensor | None:
        """The forward pass: writes the new K/V; returns float32 logits [num_logits, vocab] of the
        sequences that need them (their last new token), or None if none does."""
        if self.decode_graphs is not None and self.decode_graphs.covers(batch):
            return self._logits(batch, self.decode_graphs.forward(batch))
        input_ids = torch.tensor([t for ids in batch.token_ids for t in ids], dtype=torch.int64, device=self.device)
        metadata = self.backend.build_metadata(
            query_lens=[len(ids) for ids in batch.token_ids],
            context_lens=batch.num_computed_tokens,
            block_tables=batch.block_tables,
            geometry=self.geometry,
        )
        ctx = AttentionContext(backend=self.backend, metadata=metadata, kv_caches=self.kv_caches)
        if self.decode_plan is not None and DecodePlan.covers(input_ids, ctx):
            out, are_logits = self.decode_plan.forward(input_ids, metadata.positions, ctx)  # [T, hidden] or [T, vocab]
        else:
            out, are_logits = self.model(input_ids, metadata.positions, ctx), False
        return self._logits(batch, out, are_logits)

    def _logits(self, batch: ForwardInput, rows_out: torch.Tensor, are_logits: bool = False) -> torch.Tensor | None:
        """The logits of the rows that need them, from every row's hidden state, or from every row's
        logits already (a fused decode step's)."""
        logits_rows = batch.logits_rows()
        if not logits_rows:
            return None
        if are_logits and logits_rows == list(range(rows_out.shape[0])):
            return rows_out
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        selected = rows_out.index_select(0, rows)
        return selected if are_logits else self.model.compute_logits(selected)  # [num_logits, vocab]

    @torch.inference_mode()
    def sample(self, scheduler_output: SchedulerOutput, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """One token for each sequence that samples, from its row of `logits` (the rows forward()
        returned), and the prompt logprobs of the rows that score prompt tokens."""
        if logits is None:
            return ModelRunnerOutput([])
        requests, sampling_rows, prompt_logprobs, row = [], [], {}, 0
        for seq in scheduler_output.sequences:
            if seq.prompt_logprobs is not None:
                count = len(seq.prompt_logprobs.target_token_ids)
                prompt_logprobs[seq.request_id] = score_prompt(logits[row: row + count], seq.prompt_logprobs)
                row += count
            if seq.sampling is not None:
                requests.append(seq.sampling)
                sampling_rows.append(row)
                row += 1
        if len(sampling_rows) != logits.shape[0]:
            logits = logits[sampling_rows]
        specs = [sampling_spec(r) for r in requests]
        sampled = sample(logits, specs, grammar_mask(requests, specs)) if requests else []
        return ModelRunnerOutput(sampled, prompt_logprobs)


def grammar_mask(requests: list[SamplingRequest], specs: list[SamplingSpec]) -> TokenBitmask | None:
    """The allowed tokens of the sequences under a grammar (structured outputs), or None. A
    sequence's bans (its stop tokens before min_tokens) come off its mask, unless nothing would be
    left: then the grammar, which may only end there, wins over min_tokens."""
    rows = [i for i, r in enumerate(requests) if r.allowed_tokens is not None]
    if not rows:
        return None
    bitmasks = []
    for i in rows:
        bitmask = requests[i].allowed_tokens.get()
        if specs[i].banned_token_ids:
            without_bans = bitmask.clone()
            for token_id in specs[i].banned_token_ids:
                word, bit = divmod(token_id, 32)
                if word < len(without_bans):
                    without_bans[word] &= _int32(~(1 << bit))
            if bool(without_bans.any()):
                bitmask = without_bans
            else:
                specs[i].banned_token_ids = []
        bitmasks.append(bitmask)
    return TokenBitmask(rows, torch.stack(bitmasks))


def _int32(value: int) -> int:
    return (value + (1 << 31)) % (1 << 32) - (1 << 31)


def score_prompt(logits: torch.Tensor, request: PromptLogprobsRequest) -> list[SampledToken]:
    """logits: float32 [N, vocab], row i scoring prompt token target_token_ids[i]: each token with
    its logprob, rank and the top num_top, as the sampler reports a sampled one."""
    targets = torch.tensor(request.target_token_ids, dtype=torch.int64, device=logits.device)
    return scored_tokens(logits.log_softmax(dim=-1), targets, [request.num_top] * len(targets))


def sampling_spec(request: SamplingRequest) -> SamplingSpec:
    """The sampler's view of one sequence: min_tokens bans its stop tokens until it may stop."""
    params = request.params
    may_stop = params.may_stop_at(len(request.output_token_ids) + 1)
    banned = [] if may_stop else sorted(request.stop_token_ids)
    return SamplingSpec(params, request.seed, request.prompt_token_ids, request.output_token_ids, banned)


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose memory becomes resident only where it is written: a private
    anonymous mapping, whose pages the OS hands out zeroed on first write (torch.zeros would
    write, and so commit, the whole pool at start)."""
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape)).view(shape)  # keeps `buffer` alive
