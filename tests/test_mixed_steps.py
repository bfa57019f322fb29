"""Mixed decode + prefill steps and the attention-length ladder, against litgpt and each request run alone."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.project_executor import ProjectKernelsMode
from thunder_batch.config import ParamError, StepShape

from helpers import litgpt_greedy, mixed_prompts, tiny_gpt

S = 48
LADDER = (8, 16, 32)  # and S: four rungs


def eager(gpt, **config) -> Engine:
    defaults = {"max_seq_length": S, "prefill_chunk": 8, "attention_lengths": LADDER}
    return Engine(gpt, EngineConfig(**{**defaults, **config}, compile="eager"))


@st.composite
def traffic(draw):
    """Engine shape and requests: (arrival step, prompt, max_new_tokens, temperature, seed, abort step or None)."""
    batch = draw(st.integers(1, 3))
    shape = dict(
        batch_size=batch, prefill_chunk=draw(st.sampled_from([1, 3, 8])), prefill_lanes=draw(st.integers(0, batch))
    )
    requests = []
    for i in range(draw(st.integers(1, 6))):
        prompt_len = draw(st.integers(1, 30))
        new = draw(st.integers(1, min(8, S - prompt_len)))
        temperature = draw(st.sampled_from([0.0, 0.0, 0.8]))
        abort = draw(st.one_of(st.none(), st.integers(0, 25)))
        requests.append((draw(st.integers(0, 12)), prompt_len, new, temperature, i, abort))
    return shape, requests


def drive(engine: Engine, requests, prompts) -> dict:
    """Requests join at their arrival step and leave at their abort step; tokens out per request."""
    out, ids, step = {}, {}, 0
    while step < 400:
        for i, (arrival, _, new, temperature, seed, abort) in enumerate(requests):
            if arrival == step:
                params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=seed)
                ids[engine.add_request(prompts[i], params)] = i
            if abort is not None and abort == step and i in ids.values():
                engine.abort(next(rid for rid, j in ids.items() if j == i))
        for o in engine.step():
            out.setdefault(ids[o.request_id], []).extend(o.token_ids)
        step += 1
        if step > max(r[0] for r in requests) and not engine.has_unfinished():
            break
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traffic())
def test_random_traffic_gives_every_request_its_tokens_alone(case):
    """Random arrivals, prompt and output lengths, aborts, lanes and chunks: each request's tokens equal
    litgpt's greedy tokens (greedy) or its tokens alone in an engine of one slot (sampled); an aborted
    request's tokens are a prefix of them."""
    shape, requests = case
    gpt = tiny_gpt("llama")
    prompts = [mixed_prompts(1, [n], seed=100 + i)[0] for i, (_, n, *_) in enumerate(requests)]
    got = drive(eager(gpt, **shape), requests, prompts)
    for i, (_, _, new, temperature, seed, abort) in enumerate(requests):
        if temperature == 0:
            alone = litgpt_greedy(gpt, prompts[i], new)
        else:
            params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=seed)
            alone = eager(gpt, batch_size=1).generate([prompts[i]], params)[0].token_ids
        tokens = got.get(i, [])
        assert tokens == alone[: len(tokens)]
        if abort is None:
            assert tokens == alone


def test_ladder_rungs_follow_the_longest_busy_position():
    engine = eager(tiny_gpt("llama"), batch_size=2, prefill_chunk=4, prefill_lanes=1)
    lengths = []
    record = engine.runner.run

    def run(plan, *args):
        lengths.append(engine.runner.shape_for(plan))
        return record(plan, *args)

    engine.runner.run = run
    engine.generate([list(range(1, 7))], SamplingParams(max_new_tokens=30, ignore_eos=True))
    # 6 prompt tokens: lanes of 4 then 2 (L 8); then one decode row at positions 6 .. 34
    want = [StepShape(1, 8), StepShape(1, 8)] + [
        StepShape(0, next(r for r in (*LADDER, S) if r > p)) for p in range(6, 35)
    ]
    assert lengths == want


def test_step_shapes_are_listed_and_bounded():
    config = EngineConfig(batch_size=4, max_seq_length=1500, prefill_chunk=16, prefill_lanes=2)
    assert config.ladder == (256, 512, 1024, 1500)
    assert config.lane_counts == (1, 2, 4) and config.step_rows(2) == 4 + 2 * 16
    assert len(config.step_shapes) == 4 * 4  # (no lanes, 1, 2, 4) x 4 rungs
    assert EngineConfig(batch_size=128, prefill_chunk=16).lane_counts == (1, 2, 8, 32, 128)
    assert EngineConfig(batch_size=128, prefill_chunk=16, max_prefill_lanes=2).lane_counts == (1, 2)
    assert EngineConfig(max_seq_length=256).ladder == (256,)
    assert EngineConfig(max_seq_length=100, prefill_chunk=8, attention_lengths=[64, 32]).ladder == (32, 64, 100)
    # defaults follow the other fields, also through dataclasses.replace
    small = dataclasses.replace(EngineConfig(), batch_size=1, max_seq_length=300)
    assert (small.admit_lanes, small.lane_counts, small.ladder) == (1, (1,), (256, 300))
    assert dataclasses.replace(EngineConfig(batch_size=4), batch_size=64).lane_counts == (1, 2, 8, 32, 64)
    assert EngineConfig(prefill_chunk=1).step_shapes == tuple(StepShape(0, r) for r in (256, 512, 1024))  # no lanes
    stats = eager(tiny_gpt("llama"), batch_size=2, prefill_chunk=4).stats()
    # B = 2: lanes (1, 2)
    assert stats["step_shapes"][0] == "2 decode rows, attend 8" and len(stats["step_shapes"]) == 12


@pytest.mark.parametrize(
    "overrides, param",
    [
        (dict(attention_lengths=[0, 8]), "attention_lengths"),
        (dict(attention_lengths=[64]), "attention_lengths"),  # above max_seq_length
        (dict(attention_lengths=8), "attention_lengths"),
        (dict(prefill_lanes=-1), "prefill_lanes"),
        (dict(prefill_lanes=5), "prefill_lanes"),  # more lanes than slots
        (dict(prefill_lanes=2, max_prefill_lanes=1), "max_prefill_lanes"),
        (dict(max_prefill_lanes=5), "max_prefill_lanes"),
    ],
)
def test_bad_ladder_and_lanes_name_the_limit(overrides, param):
    with pytest.raises(ValueError, match=param) as info:
        EngineConfig(**{"batch_size": 4, "max_seq_length": 48, "prefill_chunk": 8, **overrides})
    assert not isinstance(info.value, ParamError) or info.value.param == param


@pytest.mark.regression
def test_thunder_every_shape_matches_eager_bit_for_bit(tmp_path):
    """Decode-only and mixed steps at every rung: Thunder's tokens and logprobs equal eager's, and the
    program count is the shape count, whatever the traffic."""
    config = dict(batch_size=3, max_seq_length=S, prefill_chunk=4, prefill_lanes=2, attention_lengths=LADDER)
    prompts = mixed_prompts(7, [1, 5, 13, 22], seed=3)
    params = [SamplingParams(max_new_tokens=4 + i % 5, temperature=[0.0, 0.9][i % 2], seed=i) for i in range(7)]
    results = {}
    for mode in ("eager", "thunder"):
        engine = Engine(tiny_gpt("llama"), EngineConfig(**config, compile=mode, cache_dir=str(tmp_path)))
        with (
            ProjectKernelsMode() if mode == "eager" else contextlib.nullcontext()
        ):  # the kernels Thunder's executor runs
            out = engine.generate(prompts, params)
        results[mode] = [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in out]
        if mode == "thunder":
            used = engine.stats()["cache_misses"]
            assert 1 < used <= len(engine.config.step_shapes) == 16  # (no lanes, 1, 2, 3 lanes) x 4 rungs
            engine.warmup()
            assert engine.stats()["cache_misses"] == 16
    assert results["thunder"] == results["eager"]
