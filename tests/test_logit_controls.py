"""Logit controls (penalties, logit_bias, min_p, min_tokens): the step's math against a loop written from the
rules, the engine's tokens against litgpt's uncached forward steered by that loop, batch-mates unaffected,
compiled == eager (the controls one native op, equal to their torch ops bit for bit), drafts off for controlled
requests, and bad values refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.config import ParamError
from thunder_batch.native import build
from thunder_batch.sampler import allowed_tokens, apply_controls, controlled_logits, min_p_mask

from helpers import ENGINE_CONFIG, VOCAB, mixed_prompts, tiny_gpt


def reference_logits(logits, prompt: list[int], output: list[int], p: SamplingParams, stop_ids=()) -> torch.Tensor:
    """The rules of logit_controls.py, one token at a time in float64."""
    x = logits.double().clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in stop_ids:
            x[token] = -math.inf
    for token in set(prompt) | set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token in set(output):
        x[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return x


def test_apply_controls_is_the_rules_row_by_row():
    g = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=1.7, logit_bias={3: 4.0, 9: -100}),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=2.0, logit_bias={0: 1.0}),
    ]
    logits = torch.randn(4, VOCAB, generator=g) * 3
    prompts = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in params]
    outputs = [torch.randint(0, VOCAB, (20,), generator=g).tolist() for _ in params]
    bias, counts, seen = torch.zeros(4, VOCAB), torch.zeros(4, VOCAB), torch.zeros(4, VOCAB, dtype=torch.bool)
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        for token, value in p.logit_bias:
            bias[row, token] = value
        for token in output:
            counts[row, token] += 1
        seen[row, prompt + output] = True
    knobs = torch.tensor([(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) for p in params])
    got = apply_controls(logits, bias, counts, seen, knobs)
    for row, (p, prompt, output) in enumerate(zip(params, prompts, outputs)):
        want = reference_logits(logits[row], prompt, output, p).float()
        torch.testing.assert_close(got[row], want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[2], logits[2])  # neutral knobs and no bias: the logits as they were


def test_allowed_bits_unpack_as_the_bitmask_layout_says():
    g = torch.Generator().manual_seed(2)
    words = torch.randint(-(2**31), 2**31, (3, 5), generator=g, dtype=torch.int64).to(torch.int32)
    got = allowed_tokens(words, 150)  # the last word only partly used
    want = [[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(150)] for r in range(3)]
    assert got.tolist() == want


def test_min_p_keeps_the_tokens_at_least_that_likely_relative_to_the_best():
    g = torch.Generator().manual_seed(1)
    scaled = torch.randn(3, VOCAB, generator=g) * 2
    min_p = torch.tensor([0.0, 0.2, 1.0])
    kept = min_p_mask(scaled, min_p) > -math.inf
    probs = torch.softmax(scaled.double(), -1)
    want = probs >= min_p[:, None].double() * probs.max(-1, keepdim=True).values
    assert torch.equal(kept, want) and kept[0].all() and kept[2].sum() == 1


def steered_greedy(gpt, prompt: list[int], p: SamplingParams, stop_ids=()) -> list[int]:
    """The oracle: litgpt's uncached forward over prompt + output at every step, steered by the rules."""
    output = []
    with torch.no_grad():
        while len(output) < p.max_new_tokens:
            logits = gpt(torch.tensor([prompt + output]))[0, -1].float()
            output.append(int(reference_logits(logits, prompt, output, p, stop_ids).argmax()))
            if output[-1] in stop_ids and len(output) > p.min_tokens:
                break
    return output


CONTROLLED = [
    SamplingParams(max_new_tokens=12, frequency_penalty=2.0),
    SamplingParams(max_new_tokens=12, presence_penalty=1.5, repetition_penalty=1.4),
    SamplingParams(max_new_tokens=12, repetition_penalty=2.0),
    SamplingParams(max_new_tokens=12, logit_bias={5: 6.0, 7: 3.0}, frequency_penalty=0.5),
]


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt("llama")


@pytest.fixture(scope="module")
def eager(gpt):
    return Engine(gpt, EngineConfig(compile="eager", **ENGINE_CONFIG))


def test_controlled_greedy_is_litgpt_steered_by_the_rules_beside_a_free_row(gpt, eager):
    prompts = mixed_prompts(5, [3, 9, 14, 6, 11])
    plain = SamplingParams(max_new_tokens=12)
    results = eager.generate(prompts, [*CONTROLLED, plain])
    for prompt, p, result in zip(prompts, CONTROLLED, results):
        assert result.token_ids == steered_greedy(gpt, prompt, p)
    assert results[-1].token_ids == eager.generate([prompts[-1]], plain)[0].token_ids  # batch-mates unaffected
    assert [r.token_ids for r in results[:4]] != [r.token_ids for r in eager.generate(prompts[:4], plain)]
    # Logprobs stay the model's: the free run's logprob of each token is the controlled run's where they agree.
    free = eager.generate(prompts[:1], plain)[0]
    agree = next(i for i, (a, b) in enumerate(zip(results[0].token_ids, free.token_ids)) if a != b)
    assert results[0].logprobs[:agree] == pytest.approx(free.logprobs[:agree], abs=1e-5)


def test_min_tokens_holds_back_the_stop_tokens(gpt, eager):
    [prompt] = mixed_prompts(1, [7], seed=4)
    free = eager.generate([prompt], SamplingParams(max_new_tokens=10))[0].token_ids
    stop = free[1]  # a stop token the free run reaches at its second token
    stopped = eager.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[stop]))[0]
    assert len(stopped.token_ids) <= 2 and stopped.finish_reason == "stop"
    p = SamplingParams(max_new_tokens=10, stop_token_ids=[stop], min_tokens=6)
    held = eager.generate([prompt], p)[0]
    assert len(held.token_ids) >= 6 and stop not in held.token_ids[:6]
    assert held.token_ids == steered_greedy(gpt, prompt, p, stop_ids=(stop,))


def test_min_p_one_samples_the_most_likely_token(eager):
    prompts = mixed_prompts(2, [5, 8], seed=6)
    greedy = eager.generate(prompts, SamplingParams(max_new_tokens=8))
    sampled = eager.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.5, seed=3, min_p=1.0))
    free = eager.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.5, seed=3))
    assert [r.token_ids for r in sampled] == [r.token_ids for r in greedy] != [r.token_ids for r in free]


def test_compiled_controlled_steps_equal_eager_and_make_no_new_shape(gpt, eager):
    # An engine of its own: the session's shared ones count the shapes their own traffic makes (test_parity).
    engine = Engine(gpt, EngineConfig(compile="thunder", **ENGINE_CONFIG))
    prompts = mixed_prompts(4, [4, 13, 9, 20], seed=8)
    params = [
        CONTROLLED[0],
        SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, min_p=0.05, presence_penalty=1.0),
        SamplingParams(max_new_tokens=12, temperature=0.7, top_k=20, seed=9, logit_bias={11: 2.0}, logprobs=2),
        SamplingParams(max_new_tokens=12),
    ]
    engine.generate(prompts, SamplingParams(max_new_tokens=12))  # the step shapes this traffic takes, made
    misses = engine.stats()["cache_misses"]
    with torch.profiler.profile() as profile:
        got = engine.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engine.stats()["cache_misses"] == misses  # a head variant more, no step shape more
    native = any(e.name == "thunder_batch::controlled_logits" for e in profile.events())
    assert native == (build.unavailable() is None)  # the controls ran as the one native op


@pytest.mark.parametrize("B, V", [(1, 49159), (3, 1000), (8, 20000)])
def test_the_native_controls_equal_their_torch_ops_bit_for_bit(B, V):
    if build.unavailable() is not None:
        pytest.skip(build.unavailable())
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, V, generator=g) * 5
    bias = torch.where(torch.rand(B, V, generator=g) < 0.02, torch.randn(B, V, generator=g), 0.0)
    bias[0, :7] = float("-inf")  # min_tokens' stop tokens
    counts = torch.randint(0, 4, (B, V), generator=g).float() * (torch.rand(B, V, generator=g) < 0.02)
    seen = torch.rand(B, V, generator=g) < 0.05
    allowed = torch.randint(-(2**31), 2**31 - 1, (B, -(-V // 32)), dtype=torch.int32, generator=g)
    allowed[-1] = -1  # a free row
    knobs = torch.tensor([[0.5, 0.3, 1.3, 0.0]] * B)
    knobs[0] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # neutral
    want = controlled_logits(logits, bias, counts, seen, allowed, knobs)
    got = build.controlled_logits(logits, bias, counts, seen, allowed, knobs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_stored_controlled_head_is_loaded_by_the_next_engine(gpt, tmp_path):
    """Its load-time check runs it on the probe's rows with this call's controls (the probe has none)."""
    params = SamplingParams(max_new_tokens=6, repetition_penalty=1.5, logit_bias={4: 2.0})
    config = EngineConfig(compile="thunder", cache_dir=str(tmp_path), **ENGINE_CONFIG)
    first = Engine(gpt, config).generate([[1, 2, 3]], params)
    again = Engine(gpt, config)
    assert again.generate([[1, 2, 3]], params)[0].token_ids == first[0].token_ids
    assert again.stats()["traced"] == 0 and again.stats()["disk_cache_hits"] > 0


def test_a_controlled_request_never_drafts_and_gets_the_same_tokens(gpt):
    config = EngineConfig(compile="eager", speculative_tokens=4, **ENGINE_CONFIG)
    engine = Engine(gpt, config)
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]  # prompt lookup finds drafts here
    p = SamplingParams(max_new_tokens=12, repetition_penalty=1.3)
    assert engine.generate([prompt], p)[0].token_ids == steered_greedy(gpt, prompt, p)
    assert engine.stats()["speculative"]["draft_tokens"] == 0
    free = SamplingParams(max_new_tokens=12)
    # Beside a free request that drafts, the controlled one's row in the verify steps takes its controls.
    both = engine.generate([prompt, prompt], [p, free])
    assert engine.stats()["speculative"]["verify_steps"] > 0
    assert both[0].token_ids == steered_greedy(gpt, prompt, p)
    assert (
        both[1].token_ids
        == Engine(gpt, EngineConfig(compile="eager", **ENGINE_CONFIG)).generate([prompt], free)[0].token_ids
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=40, max_new_tokens=8), "min_tokens"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={3: 101}), "logit_bias"),
    ],
)
def test_bad_controls_are_refused_by_name(fields, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**fields)
    assert e.value.param == param


def test_logit_bias_outside_the_vocabulary_is_refused_before_any_step(eager):
    with pytest.raises(ParamError, match=rf"\[0, {VOCAB}\)") as e:
        eager.prepare([1, 2], SamplingParams(logit_bias={VOCAB: 1.0}))
    assert e.value.param == "logit_bias"
    assert SamplingParams(logit_bias={"7": -100}).logit_bias == ((7, -100.0),)  # OpenAI's string keys
