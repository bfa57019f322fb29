"""batched_sample: greedy, top-k, top-p, slot independence, distribution, eager == traced, logprob."""

from __future__ import annotations

import pytest
import torch

from thunder_batch.sampler import (
    batched_sample,
    bits_to_uniform,
    filter_top_k_top_p,
    greedy_sample,
    gumbel_noise,
    random_bits,
)

V = 64


def rows(n, value, dtype):
    """A per-row parameter tensor from a scalar or a list."""
    t = torch.as_tensor(value, dtype=dtype)
    return t.expand(n).clone() if t.ndim == 0 else t


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, position=0, **kw):
    n = logits.shape[0]
    return batched_sample(
        logits,
        rows(n, temperature, torch.float32),
        rows(n, top_k, torch.int64),
        rows(n, top_p, torch.float32),
        rows(n, seed, torch.int64),
        rows(n, position, torch.int64),
        **kw,
    )


def allowed_probs(logits_row, temperature, top_k, top_p):
    """Reference (float64, Python loop): token -> probability after top-k then top-p."""
    probs = torch.softmax(logits_row.double() / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    total = sum(probs[i].item() for i in kept)
    nucleus, mass = [], 0.0
    for i in kept:  # smallest prefix whose renormalised mass reaches top_p
        nucleus.append(i)
        mass += probs[i].item() / total
        if mass >= top_p:
            break
    z = sum(probs[i].item() for i in nucleus)
    return {i: probs[i].item() / z for i in nucleus}


def chi_square_pvalue(counts, expected):
    """P-value of observed counts [V] under token -> probability `expected` (0 if off-support)."""
    counts = counts.double()
    exp = torch.tensor([expected.get(i, 0.0) for i in range(len(counts))], dtype=torch.float64)
    exp = exp * counts.sum()
    if counts[exp == 0].sum() > 0:
        return 0.0  # a token outside the allowed set
    support = exp > 0
    stat = ((counts[support] - exp[support]) ** 2 / exp[support]).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, stat / 2).item()


def test_greedy_rows_are_argmax_among_sampling_rows():
    torch.manual_seed(0)
    n = 64
    logits = torch.randn(n, V)  # [n, V] flat enough that sampling rarely hits argmax
    temperature = torch.where(torch.arange(n) % 2 == 0, 0.0, 1.0)
    tok, _ = sample(logits, temperature, top_k=torch.arange(n) % 7, top_p=0.9, seed=torch.arange(n))
    greedy = temperature == 0
    assert torch.equal(tok[greedy], logits.argmax(-1)[greedy])
    assert (tok[~greedy] != logits.argmax(-1)[~greedy]).sum() > 8  # the other rows really sample


def test_top_k_one_is_argmax_and_top_k_limits_support():
    torch.manual_seed(1)
    logits = torch.randn(8, V) * 0.5  # [8, V]
    n_seeds = 200
    tok, _ = sample(logits, 1.0, top_k=1, seed=torch.arange(8))
    assert torch.equal(tok, logits.argmax(-1))

    ks = [2, 3, 5, 10, 2, 3, 5, 10]
    big = logits.repeat_interleave(n_seeds, 0)  # [8 * n_seeds, V], row r repeated n_seeds times
    seeds = torch.arange(8 * n_seeds)
    tok, _ = sample(big, 1.5, top_k=torch.tensor(ks).repeat_interleave(n_seeds), seed=seeds, position=3)
    for r, k in enumerate(ks):
        seen = set(tok[r * n_seeds : (r + 1) * n_seeds].tolist())
        assert seen == set(logits[r].topk(k).indices.tolist())  # inside top-k, and all of it drawn

    off, _ = sample(big, 1.5, top_k=0, seed=seeds, position=3)
    beyond, _ = sample(big, 1.5, top_k=V + 5, seed=seeds, position=3)
    assert torch.equal(off, beyond)  # top_k >= V is the same as no top-k
    assert len(set(off.tolist())) > 20


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 0.3), (1.0, 0, 0.6), (0.7, 0, 0.9), (2.0, 0, 0.5), (1.0, 10, 0.8), (1.0, 0, 1e-6)],
)
def test_top_p_samples_stay_in_reference_nucleus(temperature, top_k, top_p):
    torch.manual_seed(2)
    n_rows, n_seeds = 4, 300
    logits = torch.randn(n_rows, V) * 2  # [4, V]
    big = logits.repeat_interleave(n_seeds, 0)  # [4 * n_seeds, V]
    tok, _ = sample(big, temperature, top_k, top_p, seed=torch.arange(big.shape[0]), position=11)
    for r in range(n_rows):
        allowed = allowed_probs(logits[r], temperature, top_k, top_p)
        seen = set(tok[r * n_seeds : (r + 1) * n_seeds].tolist())
        assert seen <= set(allowed)
        assert seen >= {i for i, p in allowed.items() if p > 0.05}  # likely tokens do appear
    if top_p == 1e-6:  # a tiny top_p keeps only the top token
        assert torch.equal(tok, big.argmax(-1))


def test_token_depends_only_on_own_row_seed_and_position():
    torch.manual_seed(3)
    n = 16
    probe = torch.randn(n, V)  # [n, V] the rows under test
    params = dict(temperature=torch.rand(n) + 0.5, top_k=torch.arange(n) * 3, top_p=torch.rand(n) * 0.5 + 0.5)
    seed, position = torch.randint(0, 2**31, (n,)), torch.randint(0, 4096, (n,))
    alone = [sample(probe[i : i + 1], *(p[i] for p in params.values()), seed[i], position[i]) for i in range(n)]

    # The same rows, shuffled into a larger batch among neighbours with other params.
    perm = torch.randperm(n)
    slot = torch.randperm(3 * n)[:n]  # where each permuted probe row lands
    batch = torch.randn(3 * n, V) * 3
    cols = dict(
        temperature=torch.rand(3 * n) * 2,
        top_k=torch.randint(0, V, (3 * n,)),
        top_p=(torch.rand(3 * n) + 0.01).clamp(max=1.0),
    )
    seeds, positions = torch.randint(0, 2**31, (3 * n,)), torch.randint(0, 4096, (3 * n,))
    batch[slot], seeds[slot], positions[slot] = probe[perm], seed[perm], position[perm]
    for k in cols:
        cols[k][slot] = params[k][perm]
    tok, logp = sample(batch, *cols.values(), seeds, positions)
    for j, i in enumerate(perm.tolist()):
        assert tok[slot[j]] == alone[i][0][0] and logp[slot[j]] == alone[i][1][0]


def test_different_seeds_and_positions_give_different_streams():
    logits = torch.zeros(256, V)  # [256, V] uniform: P(two independent draws agree) = 1 / V
    pos = torch.arange(256)
    a, _ = sample(logits, 1.0, seed=1, position=pos)
    b, _ = sample(logits, 1.0, seed=2, position=pos)
    shifted, _ = sample(logits, 1.0, seed=1, position=pos + 1)
    swapped, _ = sample(logits, 1.0, seed=pos, position=1)  # (seed, pos) swapped with a's keys
    for other in (b, shifted[:-1], swapped):
        agree = (a[: len(other)] == other).float().mean().item()
        assert agree < 0.06, agree  # independent streams agree ~1/64 of the time
    assert len(set(a.tolist())) > 40  # positions of one seed spread over the vocab
    assert torch.equal(a[1:], shifted[:-1])  # same (seed, position) replays the same token


def test_uniforms_strictly_inside_unit_interval_and_bits_balanced():
    extremes = torch.tensor([0, 1, 2**32 - 2, 2**32 - 1])
    u = bits_to_uniform(extremes)
    assert u.dtype == torch.float32 and (u > 0).all() and (u < 1).all()

    seed = torch.tensor([0, 1, 2**31 - 1, 12345] * 16)  # [64]
    position = torch.arange(64) * 2**26  # up to ~2**32: exercises the 32-bit mask
    bits = random_bits(seed, position, 1024)  # [64, 1024] int32: the 32 bits
    assert bits.dtype == torch.int32
    ones = torch.stack([(bits >> b) & 1 for b in range(32)]).double().mean(dim=(1, 2))  # [32]
    assert ((ones - 0.5).abs() < 0.01).all(), ones  # each bit fair (sd ~0.002 here)
    g = gumbel_noise(seed, position, 1024)
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni: the Gumbel mean


def random_bits_in_int64(seed, position, vocab_size):
    """The hash in int64 throughout, every sum and product masked to 32 bits (the sampler's first form)."""
    from thunder_batch.sampler import _MASK32, _POS_OFFSET, _SEED_HI_OFFSET, _SEED_OFFSET, _VOCAB_OFFSET, mix32

    pos = (position + _POS_OFFSET) & _MASK32
    low = mix32(mix32(((seed & _MASK32) + _SEED_OFFSET) & _MASK32) ^ pos)
    high = mix32(mix32((((seed >> 32) & _MASK32) + _SEED_HI_OFFSET) & _MASK32) ^ mix32(pos))
    vocab = mix32(torch.arange(vocab_size, dtype=torch.int64) + _VOCAB_OFFSET)
    return mix32(((low[:, None] ^ vocab[None, :]) + high[:, None]) & _MASK32)


def test_the_int32_hash_gives_the_int64_hash_bits():
    torch.manual_seed(14)
    seed = torch.cat(
        [torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 2**31, 2**32 - 1]), torch.randint(-(2**62), 2**62, (57,))]
    )
    position = torch.cat([torch.tensor([0, 2**31 - 1, 2**32 - 1, 2**32, 5, 6, 7]), torch.randint(0, 2**40, (57,))])
    bits = random_bits(seed, position, 4099)  # [64, 4099]: an odd width (vector loops' tails)
    want = random_bits_in_int64(seed, position, 4099)  # int64 in [0, 2**32)
    assert torch.equal(bits.to(torch.int64) & 0xFFFFFFFF, want)
    assert torch.equal(bits_to_uniform(bits), bits_to_uniform(want))
    assert (bits < 0).float().mean().item() > 0.45  # half the patterns have the top bit set


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8), (0.8, 6, 0.9)])
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p):
    n_vocab, n = 8, 4000
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])  # [8]
    seed, position = torch.arange(n) // 40, torch.arange(n) % 40 + 500  # both key parts vary
    tok, _ = sample(base.expand(n, n_vocab), temperature, top_k, top_p, seed, position)
    target = allowed_probs(base, temperature, top_k, top_p)
    assert chi_square_pvalue(torch.bincount(tok, minlength=n_vocab), target) > 1e-4
    # Power check: the ideal counts of a broken sampler (argmax only, uniform, temperature
    # ignored) are rejected by the same test.
    ignored_t = allowed_probs(base, 0.5 if temperature == 1.0 else 1.0, top_k, top_p)
    for wrong in ({0: 1.0}, {i: 1 / n_vocab for i in range(n_vocab)}, ignored_t):
        ideal = torch.tensor([wrong.get(i, 0.0) * n for i in range(n_vocab)])  # [8]
        assert chi_square_pvalue(ideal, target) < 1e-6, wrong


@pytest.fixture(scope="module")
def thunder():
    from thunder_batch._compat import import_thunder

    return import_thunder()


@pytest.mark.regression
def test_traced_equals_eager_bit_for_bit_with_one_trace(thunder):
    torch.manual_seed(4)
    jf = thunder.jit(batched_sample)
    n = 6
    for call in range(3):  # new parameter values each call, same shapes
        args = (
            torch.randn(n, V) * (call + 1),  # [n, V]
            torch.tensor([0.0, 1.0, 0.7, 1.3, 0.0, 2.0]) * (1 + call / 4),
            torch.tensor([0, 5, 0, 1, 10, 0]) + call,
            torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 0.3]) - call / 10,
            torch.randint(0, 2**31, (n,)),
            torch.randint(0, 2**20, (n,)) + call * 2**31,
        )
        tok, logp = jf(*args)
        ref_tok, ref_logp = batched_sample(*args)
        assert tok.dtype == torch.int64 and logp.dtype == torch.float32
        assert torch.equal(tok, ref_tok) and torch.equal(logp, ref_logp)
    assert thunder.cache_misses(jf) == 1
    src = thunder.last_traces(jf)[-1].python()
    assert "bitwise_xor" in src and "sort" in src  # the hash and the filter are in the trace


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprob_is_raw_log_softmax_at_token(dtype):
    torch.manual_seed(5)
    n = 32
    logits = (torch.randn(n, V) * 3).to(dtype)  # [n, V]
    temperature = torch.where(torch.arange(n) % 3 == 0, 0.0, 0.8)
    tok, logp = sample(logits, temperature, top_k=torch.arange(n) % 5, top_p=0.9, seed=torch.arange(n))
    assert logp.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(1, tok[:, None]).squeeze(1)  # [n]
    assert torch.equal(logp, expected)
    greedy = temperature == 0
    assert torch.equal(tok[greedy], logits.float().argmax(-1)[greedy])


def test_filter_leaves_rows_without_top_k_or_top_p_untouched():
    torch.manual_seed(6)
    n = 12
    scaled = torch.randn(n, V) * 10  # [n, V] sharp: float32 cumsum of the probs passes 1.0 early
    scaled[0, :8] = scaled[0, 8]  # ties
    scaled[1] = 0.0  # flat
    scaled[2, 5:] = float("-inf")  # a masked tail
    top_k = torch.tensor([0, V, V + 5, 0] * 3)  # [n] all mean "no top-k"
    out = filter_top_k_top_p(scaled, top_k, torch.ones(n))
    assert torch.equal(out, scaled)
    capped = filter_top_k_top_p(scaled, torch.full((n,), 3), torch.ones(n))  # top-k alone still applies
    assert ((capped > float("-inf")).sum(-1)[3:] == 3).all()


def temperature_only_batch(n, seed=7):
    """Sharp and flat rows, greedy and sampled, many seeds: [n, V] logits and per-row parameters."""
    torch.manual_seed(seed)
    logits = torch.randn(n, V) * torch.tensor([0.3, 1.0, 3.0, 10.0]).repeat(n // 4)[:, None]  # [n, V]
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.6]).repeat_interleave(n // 4)  # [n]
    return logits, temperature, torch.arange(n) * 7919, torch.arange(n) % 97 + 3


def test_unsorted_head_gives_the_same_tokens_for_greedy_and_temperature_rows():
    n = 256
    logits, temperature, seed, position = temperature_only_batch(n)
    top_k = torch.tensor([0, V, V + 1, 0]).repeat(n // 4)  # [n] all "off"
    with_sort = sample(logits, temperature, top_k, 1.0, seed, position, sort=True)
    without = sample(logits, temperature, top_k, 1.0, seed, position, sort=False)
    assert torch.equal(with_sort[0], without[0]) and torch.equal(with_sort[1], without[1])
    sampled = temperature > 0
    assert (without[0][sampled] != logits.argmax(-1)[sampled]).sum() > 40  # rows really sample


def test_temperature_row_beside_top_p_rows_equals_it_alone_unsorted():
    n = 64
    logits, temperature, seed, position = temperature_only_batch(n, seed=8)
    alone = sample(logits, temperature, 0, 1.0, seed, position, sort=False)
    # Interleave: even slots hold the rows under test, odd slots top-p / top-k neighbours.
    mixed = torch.randn(2 * n, V) * 2  # [2n, V]
    mixed[0::2] = logits
    temp2 = torch.ones(2 * n).index_copy(0, torch.arange(0, 2 * n, 2), temperature)
    top_p2 = torch.full((2 * n,), 0.5).index_fill(0, torch.arange(0, 2 * n, 2), 1.0)
    top_k2 = torch.tensor([0, 5]).repeat(n)  # odd slots also top-k 5
    seed2, pos2 = torch.arange(2 * n).index_copy(0, torch.arange(0, 2 * n, 2), seed), position.repeat_interleave(2)
    tok, logp = sample(mixed, temp2, top_k2, top_p2, seed2, pos2, sort=True)
    assert torch.equal(tok[0::2], alone[0]) and torch.equal(logp[0::2], alone[1])
    reference = [allowed_probs(mixed[i], 1.0, 5, 0.5) for i in range(1, 2 * n, 2)]
    assert all(int(t) in ref for t, ref in zip(tok[1::2], reference))  # neighbours really filtered


@pytest.mark.regression
def test_traced_unsorted_equals_eager_without_a_sort(thunder):
    torch.manual_seed(9)
    jf = thunder.jit(batched_sample)
    n = 8
    for call in range(3):
        logits, temperature, seed, position = temperature_only_batch(n, seed=10 + call)
        args = (logits, temperature, torch.zeros(n, dtype=torch.int64), torch.ones(n), seed, position + call * 2**31)
        tok, logp = jf(*args, sort=False)
        ref_tok, ref_logp = batched_sample(*args, sort=False)
        assert torch.equal(tok, ref_tok) and torch.equal(logp, ref_logp)
        assert torch.equal(tok, batched_sample(*args)[0])  # == the filtered head on these rows
    assert thunder.cache_misses(jf) == 1
    src = thunder.last_traces(jf)[-1].python()
    assert "bitwise_xor" in src and "sort(" not in src and "topk(" in src  # small top-k rows: topk, not a sort


@pytest.mark.regression
def test_greedy_head_equals_greedy_rows_of_the_sampler(thunder):
    """greedy_sample: the tokens and logprobs batched_sample gives greedy rows, bit for bit, eager
    and traced, with no random noise in the trace."""
    n = 16
    logits, _, seed, position = temperature_only_batch(n, seed=11)
    zero = torch.zeros(n)
    want = sample(logits, zero, 0, 1.0, seed, position)
    jf = thunder.jit(greedy_sample)
    for got in (greedy_sample(logits), jf(logits)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(want[0], logits.argmax(-1))
    src = thunder.last_traces(jf)[-1].python()
    assert "bitwise_xor" not in src and "sort" not in src


def small_top_k_batch(n, vocab, seed):
    """Sharp and flat rows at temperature 0.8, top-k 1..64 each with top-p 1, 0.95, 0.9 or 0.5."""
    torch.manual_seed(seed)
    logits = torch.randn(n, vocab) * torch.tensor([0.5, 2.0, 6.0]).repeat(n // 3)[:, None]  # [n, vocab]
    top_k = torch.tensor([1, 2, 5, 17, 40, 64]).repeat(n // 6)  # [n]
    top_p = torch.tensor([1.0, 0.95, 0.9, 0.5]).repeat(n // 4)  # [n]
    return logits, torch.full((n,), 0.8), top_k, top_p, torch.arange(n) * 31 + seed, torch.arange(n) + 5


def test_a_small_top_k_row_draws_what_the_sorted_filter_allows():
    """Rows with top-k <= SMALL_TOP_K draw from their top-k values (torch.topk) instead of sorting the
    vocabulary: the same token as the Gumbel-max over the sort-filtered row (the sampler before)."""
    from thunder_batch.sampler import SMALL_TOP_K, gumbel_noise

    assert SMALL_TOP_K == 64
    vocab = 1000
    logits, temperature, top_k, top_p, seed, position = small_top_k_batch(96, vocab, seed=12)
    for sort in (False, True):
        tok, logp = batched_sample(logits, temperature, top_k, top_p, seed, position, sort=sort)
        filtered = filter_top_k_top_p(logits / temperature[:, None], top_k, top_p)  # [n, vocab]
        assert torch.equal(tok, (filtered + gumbel_noise(seed, position, vocab)).argmax(-1))
        assert torch.equal(logp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))
    assert len(set(tok[top_k == 64].tolist())) > 8  # rows really sample


def test_a_small_top_k_row_beside_rows_that_need_the_sort_equals_it_alone_unsorted():
    vocab, n = 1000, 48
    logits, temperature, top_k, top_p, seed, position = small_top_k_batch(n, vocab, seed=13)
    alone = batched_sample(logits, temperature, top_k, top_p, seed, position, sort=False)
    # Interleave: even slots hold the rows under test, odd slots top-p only or top-k 100 (both need the sort).
    odd = torch.arange(1, 2 * n, 2)
    mixed = (torch.randn(2 * n, vocab) * 2).index_copy(0, odd - 1, logits)  # [2n, vocab]
    top_k2 = torch.tensor([0, 100]).repeat(n).index_copy(0, odd - 1, top_k)  # [2n]
    top_p2 = torch.full((2 * n,), 0.7).index_copy(0, odd - 1, top_p)
    temp2 = torch.ones(2 * n).index_copy(0, odd - 1, temperature)
    seed2, pos2 = torch.arange(2 * n).index_copy(0, odd - 1, seed), position.repeat_interleave(2)
    tok, logp = batched_sample(mixed, temp2, top_k2, top_p2, seed2, pos2, sort=True)
    assert torch.equal(tok[0::2], alone[0]) and torch.equal(logp[0::2], alone[1])
    reference = [allowed_probs(mixed[i], 1.0, int(top_k2[i]), 0.7) for i in odd.tolist()]
    assert all(int(t) in ref for t, ref in zip(tok[1::2], reference))  # neighbours really filtered
