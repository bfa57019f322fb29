"""Batched sampling with per-row parameters, traceable by Thunder (no host sync, no Generator).

Every row draws from softmax(logits / temperature) restricted by its own top-k, then its own
top-p (nucleus), or takes the argmax where temperature == 0. Randomness comes from a
counter-based hash of (seed, position, vocab index) turned into Gumbel noise, so a row's token
depends only on its own logits, parameters, seed and position: never on its slot or batch-mates.

The whole 64-bit seed keys the stream: its low and high 32-bit halves go through two hash lanes
that each stay a bijection of their half at every position, so two seeds that differ in any bit
never share a key (users' seeds are in [0, 2**63); `config.choice_seed` derives the streams of
extra choices in the negative half). The per-row and per-token keys are hashed in int64 with every
value < 2**33 and every multiplier < 2**27, so no product reaches 2**63; the [B, V] part, where the
memory traffic is, in int32 holding the same 32 bits (sums and products wrap modulo 2**32 as the int64
masks do: `tests/test_sampler.py` checks the bits against the int64 form). Eager torch and the traced
program agree bit-for-bit. Thunder's TensorProxy has no `%` operator; masking with `&` avoids it.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # odd multiplier of a well-mixing 32-bit xorshift-multiply hash (< 2**27)
# Distinct offsets per key part so that zeros do not hash to the fixed point mix(0) == 0.
_SEED_OFFSET = 0x2545F491
_SEED_HI_OFFSET = 0x68E31DA4
_POS_OFFSET = 0x1B873593
_VOCAB_OFFSET = 0x3C6EF372


def mix32(x: Tensor) -> Tensor:
    """Bijective 32-bit hash of int64 values in [0, 2**32); output also in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def mix32_bits(x: Tensor) -> Tensor:
    """mix32 on int32 tensors that hold the 32 bits (two's complement): the same bits at half the
    memory traffic of int64, for the [B, V] part. Products wrap modulo 2**32 (the int64 form's masks);
    right shifts are made logical by masking the sign's copies."""
    x = ((x >> 16) & 0xFFFF) ^ x
    x = x * _MULT
    x = ((x >> 16) & 0xFFFF) ^ x
    x = x * _MULT
    return ((x >> 16) & 0xFFFF) ^ x


def random_bits(seed: Tensor, position: Tensor, vocab_size: int) -> Tensor:
    """32 random bits per (row, vocab index) as int32 (two's complement), keyed by the row's (seed,
    position) only. seed: [B] any int64 (all 64 bits count); position: [B] int64 >= 0."""
    pos = (position + _POS_OFFSET) & _MASK32  # [B]
    # Two lanes, each a bijection of its seed half for a given position: distinct seeds, distinct keys.
    low = mix32(mix32(((seed & _MASK32) + _SEED_OFFSET) & _MASK32) ^ pos)  # [B]
    high = mix32(mix32((((seed >> 32) & _MASK32) + _SEED_HI_OFFSET) & _MASK32) ^ mix32(pos))  # [B]
    vocab = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)  # [V]
    vocab = mix32(vocab + _VOCAB_OFFSET)  # [V]
    low, high, vocab = (t.to(torch.int32) for t in (low, high, vocab))  # the same 32 bits
    return mix32_bits((low[:, None] ^ vocab[None, :]) + high[:, None])  # [B, V]: the sum wraps as & _MASK32 did


def bits_to_uniform(bits: Tensor) -> Tensor:
    """Top 23 of 32 bits (int32 as `random_bits` gives them, or int64 in [0, 2**32)) -> float32
    strictly inside (0, 1): (k + 0.5) / 2**23 is exact in float32."""
    return (((bits >> 9) & 0x7FFFFF).to(torch.float32) + 0.5) * (1.0 / 2**23)  # [B, V]


def gumbel_noise(seed: Tensor, position: Tensor, vocab_size: int) -> Tensor:
    """Standard Gumbel noise -log(-log(u)), one value per (row, vocab index)."""
    u = bits_to_uniform(random_bits(seed, position, vocab_size))  # [B, V]
    return -torch.log(-torch.log(u))  # [B, V]


SMALL_TOP_K = 64  # rows with 0 < top_k <= this draw from their top-k values, without a sort


def filter_top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask with -inf every token outside the row's top-k, then outside its nucleus top-p."""
    vocab_size = scaled.shape[-1]
    sorted_vals, _ = torch.sort(scaled, dim=-1, descending=True)  # [B, V]
    rank = torch.arange(vocab_size, device=scaled.device)  # [V]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)  # [B]; 0 = off
    in_top_k = rank[None, :] < k[:, None]  # [B, V]
    sorted_vals = torch.where(in_top_k, sorted_vals, float("-inf"))  # [B, V]
    threshold = nucleus_threshold(sorted_vals, in_top_k, top_p)  # [B, 1]
    return torch.where(scaled >= threshold, scaled, float("-inf"))  # [B, V]


def nucleus_threshold(sorted_vals: Tensor, in_top_k: Tensor, top_p: Tensor) -> Tensor:
    """The smallest value a row keeps: sorted_vals[B, W] descending, -inf past the row's top-k
    (in_top_k [B, W], rank 0 always in), top_p [B]. -> [B, 1]"""
    rank = torch.arange(sorted_vals.shape[-1], device=sorted_vals.device)  # [W]
    probs = torch.softmax(sorted_vals, dim=-1)  # [B, W] renormalised over the top-k
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [B, W]
    # Keep a token while the mass above it is still short of top_p; rank 0 always stays. top_p >= 1
    # keeps all: float32 cumsum can pass 1.0 before the tail and would drop tail tokens.
    short = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)  # [B, W]
    keep = in_top_k & (short | (rank[None, :] == 0))  # [B, W]
    n_keep = keep.sum(dim=-1, keepdim=True)  # [B, 1], >= 1
    return torch.gather(sorted_vals, 1, n_keep - 1)  # [B, 1]


def draw_small_top_k(scaled: Tensor, noise: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The Gumbel-max draw of rows with 0 < top_k <= SMALL_TOP_K among their top-k / top-p tokens, from
    their K largest values (`torch.topk`: far cheaper than sorting 49,152, benchmarks/RESULTS.md, "Sampling
    steps: top-k without the sort"); other rows' values are meaningless. scaled, noise: [B, V]; top_k,
    top_p: [B] -> token [B]. Ties at a row's k-th value: K of them are candidates (the full sort's mask
    keeps them all)."""
    K = min(SMALL_TOP_K, scaled.shape[-1])
    top, ids = torch.topk(scaled, K, dim=-1)  # [B, K] descending, their vocabulary ids
    rank = torch.arange(K, device=scaled.device)  # [K]
    k = torch.where((top_k > 0) & (top_k <= K), top_k, K)  # [B]; other rows: any k >= 1 (unused)
    in_top_k = rank[None, :] < k[:, None]  # [B, K]
    top = torch.where(in_top_k, top, float("-inf"))  # [B, K]
    kept = top >= nucleus_threshold(top, in_top_k, top_p)  # [B, K]
    noisy = torch.where(kept, top + torch.gather(noise, 1, ids), float("-inf"))  # [B, K]
    return torch.gather(ids, 1, noisy.argmax(dim=-1, keepdim=True)).squeeze(1)  # [B]


def apply_controls(logits: Tensor, bias: Tensor, counts: Tensor, seen: Tensor, knobs: Tensor) -> Tensor:
    """The logit controls before temperature (logit_controls.py, vLLM's order): logit_bias (-inf on the stop
    tokens min_tokens holds back), the repetition penalty on tokens seen in the prompt or output, then the
    frequency and presence penalties on the output's counts (a grammar's -inf, `mask_disallowed`, stays -inf).
    logits, bias, counts: [B, V] float32; seen: [B, V] bool; knobs: [B, 4] float32 (presence, frequency,
    repetition, min_p); a row at (0, 0, 1, 0) with zero bias keeps its logits. -> [B, V]"""
    x = logits + bias  # [B, V]
    repetition = knobs[:, 2:3]  # [B, 1]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)  # [B, V]
    return x - knobs[:, 1:2] * counts - knobs[:, 0:1] * (counts > 0).to(x.dtype)  # [B, V]


def controlled_logits(
    logits: Tensor, bias: Tensor, counts: Tensor, seen: Tensor, allowed: Tensor, knobs: Tensor
) -> tuple[Tensor, Tensor]:
    """(reported, steered): float32 logits [B, V] under the rows' grammar masks (`mask_disallowed`: what logprobs
    report), and those after the other controls (`apply_controls`: what is sampled). One native op in a compiled
    CPU step (compile/controls_op.py)."""
    reported = mask_disallowed(logits, allowed)  # [B, V]
    return reported, apply_controls(reported, bias, counts, seen, knobs)  # [B, V] each


def mask_disallowed(logits: Tensor, allowed: Tensor) -> Tensor:
    """-inf where the row's grammar allows no token (constraints.py). logits: [B, V]; allowed: [B, ceil(V / 32)]
    int32 bits (token t: bit t & 31 of word t >> 5; every bit set: the row as it is) -> [B, V]"""
    return torch.where(allowed_tokens(allowed, logits.shape[-1]), logits, float("-inf"))  # [B, V]


def allowed_tokens(allowed: Tensor, vocab_size: int) -> Tensor:
    """Bitmask rows [B, W] int32 -> [B, vocab_size] bool (token t: bit t & 31 of word t >> 5)."""
    vocab = torch.arange(vocab_size, device=allowed.device)  # [V]
    words = allowed.index_select(1, vocab >> 5)  # [B, V]
    return ((words >> (vocab & 31).to(torch.int32)) & 1) != 0  # [B, V]: an arithmetic shift; bit 0 is exact


def min_p_mask(scaled: Tensor, min_p: Tensor) -> Tensor:
    """-inf on tokens less likely than min_p x the row's most likely: scaled [B, V] (after temperature),
    min_p [B] in [0, 1] (0 keeps all: log 0 = -inf) -> [B, V]. In log space: p_i >= min_p * p_max."""
    floor = scaled.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]  # [B, 1]
    return torch.where(scaled >= floor, scaled, float("-inf"))  # [B, V]


def batched_sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seed: Tensor,
    position: Tensor,
    *,
    sort: bool = True,
    min_p: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """logits[B, V] float (any float dtype; compute in float32), temperature[B] float32 (0 = greedy),
    top_k[B] int64 (0 = no top-k), top_p[B] float32 in (0, 1] (1 = off), seed[B] int64 (any value),
    position[B] int64 (the absolute sequence position of the token being sampled).
    Returns (token[B] int64, logprob[B] float32) where logprob is log_softmax of the raw logits
    (temperature 1, no filtering) at the chosen token.

    Rows with 0 < top_k <= SMALL_TOP_K draw from their top-k values (`draw_small_top_k`) in every
    step; sort=False (a Python bool: each value is its own trace) skips the full-vocabulary sort that
    filters the others, and leaves them unfiltered. Use it only when no row that counts needs that sort
    (`needs_sort`): every row then gets bit-identical tokens and logprobs either way. min_p [B]: each row's
    `min_p_mask` before top-k / top-p (None: none)."""
    logits = logits.float()  # [B, V]
    greedy = temperature <= 0  # [B]
    # Greedy rows divide by 1 so no inf/nan is formed; their sampled value is discarded.
    temp = torch.where(greedy, 1.0, temperature)  # [B]
    scaled = logits / temp[:, None]  # [B, V]
    if min_p is not None:
        scaled = min_p_mask(scaled, min_p)  # [B, V]
    noise = gumbel_noise(seed, position, logits.shape[-1])  # [B, V]
    # Gumbel-max: argmax(scaled + Gumbel) is a draw from softmax(scaled).
    drawn = ((filter_top_k_top_p(scaled, top_k, top_p) if sort else scaled) + noise).argmax(dim=-1)  # [B]
    small = (top_k > 0) & (top_k <= SMALL_TOP_K)  # [B]
    drawn = torch.where(small, draw_small_top_k(scaled, noise, top_k, top_p), drawn)  # [B]
    token = torch.where(greedy, logits.argmax(dim=-1), drawn)  # [B]
    return token, logprob_of(logits, token)


def needs_sort(top_k: int | None, top_p: float) -> bool:
    """Whether a sampling row's top-k (None or 0: off) and top-p need `batched_sample`'s full-vocabulary sort."""
    top_k = top_k or 0
    return not 0 < top_k <= SMALL_TOP_K and (top_k > 0 or top_p < 1)


def greedy_sample(logits: Tensor) -> tuple[Tensor, Tensor]:
    """`batched_sample` for steps where every row that counts is greedy: the argmax and its logprob,
    bit-identical to what `batched_sample` gives a greedy row, without drawing any random noise."""
    logits = logits.float()  # [B, V]
    token = logits.argmax(dim=-1)  # [B]
    return token, logprob_of(logits, token)


def logprob_of(logits: Tensor, token: Tensor) -> Tensor:
    """log_softmax of float32 logits[B, V] at token[B] -> [B]."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    return torch.gather(logprobs, 1, token[:, None]).squeeze(1)  # [B]


def top_logprobs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k most likely tokens of each row of logits[R, V] and their logprobs, the same log_softmax
    of the float32 logits as `logprob_of` -> (ids [R, k] int64, logprobs [R, k] float32), best first."""
    values, ids = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)  # [R, k] each
    return ids, values


def score_rows(logits: Tensor, target: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Every row's logprob of its target token and its k best alternatives: logits[R, V], target[R]
    -> (logprob [R], ids [R, k], logprobs [R, k])."""
    logits = logits.float()  # [R, V]
    ids, values = top_logprobs(logits, k)
    return logprob_of(logits, target), ids, values
