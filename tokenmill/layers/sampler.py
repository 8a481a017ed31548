"""Batched sampling: penalties, logit bias, banned tokens, temperature, top-k/top-p/min-p,
greedy and seeded random sampling, logprobs.

Random draws come from a counter-based hash of (request seed, output index, token id),
so a request's samples depend only on its own seed and position: never on what else is
in the batch, and never on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.layers.cpu_kernels import kernels_available
from tokenmill.outputs import SampledToken
from tokenmill.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingSpec:
    """What the sampler needs to know about one sequence that samples this step."""

    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int] = field(default_factory=list)  # never sampled (stop tokens before min_tokens)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # murmur3's finaliser on int64 tensors holding 32-bit values
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [R, V], a pure function of (seed, counter, token id)."""
    device = seeds.device
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32
    row_key = _fmix32(_fmix32(seed_lo ^ _fmix32(seed_hi + 0x9E3779B9)) ^ (counters & _MASK32))
    token_key = _fmix32((torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x9E3779B1) & _MASK32)
    return -torch.log(-torch.log(uniform_from_bits(_fmix32(row_key[:, None] ^ token_key[None, :]))))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits -> float32 strictly inside (0, 1). 23 of them: with 24, (2^24 - 1 + 0.5) / 2^24
    rounds to 1.0 in float32, whose Gumbel noise is +inf (one token in 2^24 sampled regardless of
    its probability, or a NaN next to a -inf logit)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)


def _apply_penalties(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    batch, vocab = logits.shape
    device = logits.device
    out_ids = _padded([s.output_token_ids for s in specs], vocab, device)
    counts = torch.zeros(batch, vocab + 1, device=device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
    counts = counts[:, :vocab]
    prompt_ids = _padded([s.prompt_token_ids for s in specs], vocab, device)
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :vocab] | (counts > 0)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]

    rep = column([s.params.repetition_penalty for s in specs])
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - column([s.params.frequency_penalty for s in specs]) * counts
    return logits - column([s.params.presence_penalty for s in specs]) * (counts > 0)


def _apply_logit_bias_and_bans(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    rows, cols, values = [], [], []
    vocab = logits.shape[1]
    for i, s in enumerate(specs):
        for token_id, bias in (s.params.logit_bias or {}).items():
            if 0 <= token_id < vocab:
                rows.append(i), cols.append(token_id), values.append(bias)
        for token_id in s.banned_token_ids:
            if 0 <= token_id < vocab:
                rows.append(i), cols.append(token_id), values.append(float("-inf"))
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits = logits.index_put(index, torch.tensor(values, device=logits.device), accumulate=True)
    return logits


def _filter_top_k_top_p_min_p(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[1]
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in specs], device=device)
    top_p = torch.tensor([s.params.top_p for s in specs], dtype=logits.dtype, device=device)
    min_p = torch.tensor([s.params.min_p for s in specs], dtype=logits.dtype, device=device)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        remove = ranks >= top_k[:, None]
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # drop a token once the mass strictly before it already reaches top_p (keeps at least one)
        remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        logits = logits.scatter(1, sorted_idx, sorted_logits.masked_fill(remove, float("-inf")))
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def argmax(rows: torch.Tensor) -> torch.Tensor:
    """rows.argmax(-1) for float32 [B, V]; our kernel on the CPU (ATen's takes ~90 us a row of a
    49k vocabulary, ~3 ms a step at batch 64)."""
    if rows.device.type == "cpu" and rows.dtype == torch.float32 and _argmax_kernel_available():
        return torch.ops.tokenmill.argmax_rows.default(rows)
    return rows.argmax(dim=-1)


_argmax_kernel_available = kernels_available  # a name of this module's own, for tests to switch off


@dataclass
class TokenBitmask:
    """Structured outputs: the tokens some rows may sample. bitmask: int32 [len(rows), ceil(V / 32)],
    bit j of word w set when token 32 * w + j is allowed."""

    rows: list[int]
    bitmask: torch.Tensor

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """bool [len(rows), V]."""
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        bits = (self.bitmask.to(device)[:, :, None] >> shifts) & 1  # [R, W, 32]
        return bits.reshape(len(self.rows), -1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, mask: TokenBitmask) -> None:
    """The tokens mask's rows may not sample get -inf, in place."""
    rows = torch.tensor(mask.rows, dtype=torch.int64, device=logits.device)
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(1) == 1
            and _bitmask_kernel_available()):
        torch.ops.tokenmill.apply_token_bitmask_.default(logits, rows, mask.bitmask.contiguous())
        return
    allowed = mask.allowed(logits.shape[1], logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


_bitmask_kernel_available = kernels_available  # a name of this module's own, for tests to switch off


def sample(logits: torch.Tensor, specs: list[SamplingSpec], mask: TokenBitmask | None = None) -> list[SampledToken]:
    """logits: [B, V] float32 raw model logits, one row per spec; `mask` limits some rows' tokens
    (structured outputs), and its rows of `logits` are overwritten."""
    device = logits.device
    max_logprobs = max((s.params.logprobs for s in specs if s.params.logprobs is not None), default=None)
    raw_logprobs = logits.log_softmax(dim=-1) if max_logprobs is not None else None

    if mask is not None and mask.rows:
        apply_token_bitmask_(logits, mask)
    logits = _apply_logit_bias_and_bans(logits, specs)
    if any(s.params.has_penalties for s in specs):
        logits = _apply_penalties(logits, specs)

    is_greedy = [s.params.is_greedy for s in specs]
    token_ids = argmax(logits)
    if not all(is_greedy):
        rows = torch.tensor([i for i, g in enumerate(is_greedy) if not g], device=device)
        random_specs = [s for s in specs if not s.params.is_greedy]
        temperature = torch.tensor([s.params.temperature for s in random_specs], device=device)
        scaled = _filter_top_k_top_p_min_p(logits[rows] / temperature[:, None], random_specs)
        seeds = torch.tensor([s.seed for s in random_specs], dtype=torch.int64, device=device)
        counters = torch.tensor([len(s.output_token_ids) for s in random_specs], dtype=torch.int64, device=device)
        noisy = scaled.log_softmax(dim=-1) + gumbel_noise(seeds, counters, logits.shape[1])
        token_ids = token_ids.index_put((rows,), argmax(noisy))

    if raw_logprobs is None:
        return [SampledToken(int(t)) for t in token_ids.tolist()]
    return scored_tokens(raw_logprobs, token_ids, [s.params.logprobs for s in specs])


def scored_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int | None]) -> list[SampledToken]:
    """Each row's token with its logprob, its rank and the row's num_top[i] most likely tokens
    (None: the token alone, no logprobs), reduced on the device, one host transfer.
    logprobs: float32 [N, V] log-softmax; token_ids: int64 [N]."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(1, max((k for k in num_top if k is not None), default=0)), dim=-1)
    packed = torch.cat([token_ids[:, None].to(logprobs.dtype), chosen, ranks[:, None].to(logprobs.dtype)], 1)
    packed, top_values, top_ids = packed.tolist(), top_values.tolist(), top_ids.tolist()
    results = []
    for i, k in enumerate(num_top):
        token, logprob, rank = packed[i]
        top = None if k is None else list(zip(top_ids[i][:k], top_values[i][:k]))
        results.append(SampledToken(int(token), logprob if k is not None else None, int(rank), top))
    return results
