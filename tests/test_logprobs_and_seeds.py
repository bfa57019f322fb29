"""The full 63-bit seed keys the RNG (choices of one request get streams no client seed can reach);
logprob alternatives and prompt logprobs equal log_softmax of litgpt's own forward pass, change no
token of the request or of its batch-mates, and are the same traced as eager."""

from __future__ import annotations

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.project_executor import ProjectKernelsMode
from thunder_batch.config import MAX_SEED, choice_seed
from thunder_batch.sampler import batched_sample

from helpers import ENGINE_CONFIG, VOCAB, mixed_prompts, tiny_gpt

V = 64


def draws(seed: int, n: int = 512) -> torch.Tensor:
    """Tokens drawn from uniform logits at positions 0..n-1 under one seed."""
    rows = torch.zeros(n, V)
    return batched_sample(
        rows, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.full((n,), seed), torch.arange(n)
    )[0]


@pytest.mark.parametrize("other", [5 + 2**31, 5 + 2**32, 5 + 2**62, 5 ^ (1 << 45), choice_seed(5, 1), 6])
def test_seeds_differing_in_any_bit_give_independent_streams(other):
    base = draws(5)
    assert torch.equal(base, draws(5))
    agree = (base == draws(other)).float().mean().item()
    assert agree < 0.05, agree  # independent uniform draws agree 1/64 of the time


@pytest.mark.regression
def test_traced_sampler_equals_eager_over_the_whole_seed_range():
    from thunder_batch._compat import import_thunder

    thunder = import_thunder()
    jf = thunder.jit(batched_sample)
    seeds = torch.tensor([0, 5, 5 + 2**31, 2**40 + 3, MAX_SEED, choice_seed(5, 1), choice_seed(MAX_SEED, 7), -1])
    n = len(seeds)
    torch.manual_seed(0)
    for call in range(2):
        args = (torch.randn(n, V), torch.full((n,), 0.9), torch.zeros(n, dtype=torch.long), torch.ones(n), seeds)
        args += (torch.arange(n) + call * 2**33,)
        got, want = jf(*args), batched_sample(*args)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert thunder.cache_misses(jf) == 1


def test_choice_seeds_never_reach_client_seeds():
    for seed in (0, 1, 5, MAX_SEED):
        derived = [choice_seed(seed, i) for i in range(1, 200)]
        assert choice_seed(seed, 0) == seed
        assert all(-(2**63) <= d < 0 for d in derived) and len(set(derived)) == len(derived)


def eager(gpt=None, **config) -> Engine:
    return Engine(gpt or tiny_gpt("llama"), EngineConfig(compile="eager", **{**ENGINE_CONFIG, **config}))


def test_engine_keeps_the_whole_seed():
    engine = eager()
    prompt = mixed_prompts(1, [5])[0]

    def tokens(seed):
        params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate([prompt], params)[0].token_ids

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(5 + 2**31) != tokens(5 + 2**62)
    unseeded = engine.prepare(prompt, SamplingParams(), [None] * 24)
    assert any(r.seed >= 2**32 for r in unseeded)  # unseeded requests draw all 63 bits too
    assert [r.seed for r in engine.prepare(prompt, SamplingParams(seed=9), ["a", "b"])] == [9, choice_seed(9, 1)]


def oracle(gpt, ids: list[int]) -> torch.Tensor:
    """log_softmax of litgpt's own forward pass over the whole sequence: [T, V]."""
    with torch.no_grad():
        return torch.log_softmax(gpt(torch.tensor([ids]))[0].float(), dim=-1)


LOGPROB_PARAMS = [
    SamplingParams(max_new_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True),
    SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=3, logprobs=2, prompt_logprobs=0, ignore_eos=True),
]


@pytest.mark.parametrize("lanes", [None, 0])  # prompts in lanes of 8, or one token per step
def test_logprobs_equal_log_softmax_of_litgpt_forward(lanes):
    engine = eager(prefill_lanes=lanes)
    gpt = tiny_gpt("llama")  # the same weights, without the engine's caches
    prompts = mixed_prompts(2, [13, 3], seed=4)
    for prompt, params, result in zip(prompts, LOGPROB_PARAMS, engine.generate(prompts, LOGPROB_PARAMS)):
        full = oracle(gpt, prompt + result.token_ids)  # [T, V]
        P = len(prompt)
        rows = full[P - 1 : P - 1 + len(result.token_ids)]  # the distributions the tokens were drawn from
        got = torch.tensor(result.logprobs)
        assert torch.allclose(got, rows.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0], atol=1e-4)
        assert_top(result.top_logprobs, rows, params.logprobs)
        assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == P
        want = full[: P - 1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert torch.allclose(torch.tensor(result.prompt_logprobs[1:]), want, atol=1e-4)
        assert result.prompt_top_logprobs[0] is None
        assert_top(result.prompt_top_logprobs[1:], full[: P - 1], params.prompt_logprobs)


def assert_top(got: list, rows: torch.Tensor, k: int) -> None:
    assert len(got) == len(rows) and all(len(g) == k for g in got)
    if k:
        values, ids = rows.topk(k, dim=-1)
        assert [[t for t, _ in g] for g in got] == ids.tolist()
        assert torch.allclose(torch.tensor([[lp for _, lp in g] for g in got]), values, atol=1e-4)


def outputs(results) -> list:
    return [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in results]


def test_asking_for_logprobs_changes_no_token_of_anyone():
    prompts = mixed_prompts(4, [13, 3, 20, 9], seed=6)
    plain = [
        SamplingParams(max_new_tokens=8, temperature=t, seed=i, ignore_eos=True) for i, t in enumerate((0, 1, 0.7, 0))
    ]
    asking = [plain[0], SamplingParams(**{**_kw(plain[1]), "logprobs": 4, "prompt_logprobs": 2}), plain[2], plain[3]]
    engine = eager()
    first = outputs(engine.generate(prompts, asking))
    engine.reset_prefix_cache()  # the same plans again: kept prompts would be fed through other rows (other bits)
    assert first == outputs(engine.generate(prompts, plain))


def _kw(params: SamplingParams) -> dict:
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")
    return {n: getattr(params, n) for n in names}


@pytest.mark.regression
def test_logprob_heads_traced_equal_eager_bit_for_bit(thunder_engine):
    prompts = mixed_prompts(3, [13, 3, 20], seed=7)
    # The third request's top-p needs the sampler's sort: the steps it samples in run the "filtered" heads.
    third = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=11, logprobs=3, ignore_eos=True)
    params = [*LOGPROB_PARAMS, third]

    def everything(results):
        return [(r.token_ids, r.logprobs, r.top_logprobs, r.prompt_logprobs, r.prompt_top_logprobs) for r in results]

    compiled = thunder_engine("llama")
    with ProjectKernelsMode():  # eager with the kernels Thunder's executor runs (packed linears, decode attention)
        want = everything(eager().generate(prompts, params))
    assert everything(compiled.generate(prompts, params)) == want
    assert VOCAB == compiled.vocab_size
    made = set(compiled.stats()["programs"])  # made on first use
    assert {"head-filtered_top", "head-unsorted_prompt"} <= made, made
