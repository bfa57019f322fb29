"""Speculative decoding (issue 29): prompt-lookup drafts, verify steps, and outputs identical to
speculative_tokens=0 (greedy and seeded), stops / EOS / max_tokens / logprobs included."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.bench.speculative import ceiling_speedup, makespan, steps_if_every_draft_checked
from thunder_batch.compile.step import execution_traces
from thunder_batch.config import ParamError, StepShape
from thunder_batch.drafts import (
    GATE_MIN_STEPS,
    PRIOR_ACCEPTED,
    Acceptance,
    Drafter,
    DraftGate,
    accepted_tokens,
    prompt_lookup,
)
from thunder_batch.request import Request
from thunder_batch.step_plan import SlotWork, StepPlan

from helpers import mixed_prompts, tiny_gpt

CONFIG = dict(batch_size=4, max_seq_length=128, prefill_chunk=8)
# Random prompts, and repetitive ones: a tiny random model's greedy output falls into loops, which
# drafts then catch, while other drafts are rejected.
PROMPTS = mixed_prompts(6, [5, 12, 20, 3]) + [[1, 2, 3, 4, 5] * 4, [7, 7, 9] * 5]


# -- drafts -----------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_most_recent_occurrence():
    history = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert prompt_lookup(history, 3, 2, 3) == [4, 5, 6]  # [1, 2, 3] last seen before 4, not before 9
    assert prompt_lookup(history, 2, 2, 3) == [4, 5]  # at most k
    assert prompt_lookup([5, 6, 7, 8, 6, 7], 4, 2, 3) == [8, 6, 7]  # up to the end of the history
    assert prompt_lookup([1, 2, 3, 4], 4, 2, 3) == []  # nothing repeats
    assert prompt_lookup([1, 2, 3], 4, 1, 1) == []  # the last token alone: nowhere earlier
    assert prompt_lookup([3, 1, 2, 3], 4, 1, 3) == [1, 2, 3]  # n = 1 when no longer tail occurs


def test_prompt_lookup_prefers_the_longest_ngram():
    # [4, 5] last occurred before 8, but the longer [3, 4, 5] before 6
    history = [3, 4, 5, 6, 0, 4, 5, 8, 0, 3, 4, 5]
    assert prompt_lookup(history, 1, 2, 3) == [6]
    assert prompt_lookup(history, 1, 2, 2) == [8]


def test_accepted_tokens_are_the_drafts_that_match_samples_then_one_sample():
    assert accepted_tokens([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all stood: k + 1 tokens
    assert accepted_tokens([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # 5 rejected: the sample there instead
    assert accepted_tokens([4, 5, 6], [8, 5, 6, 7]) == [8]  # none stood: what plain decoding gives
    assert accepted_tokens([], [3]) == [3]


def test_the_drafts_ceiling_counts_the_steps_if_every_draft_were_checked():
    prompt, output = [7, 1, 2, 3, 4, 5, 8, 1, 2], [3, 4, 5, 9, 1, 2, 3]
    # [1, 2] ends the prompt: draft [3, 4, 5, 8], 3 stand (4 tokens); no draft after [5, 9] nor [9, 1];
    # after [1, 2] again the draft would stand, but the output's last token is a step's own sample.
    assert steps_if_every_draft_checked(prompt, output, 4, 2, 3) == 4
    assert steps_if_every_draft_checked(prompt, output, 2, 2, 3) == 5  # [3, 4] stand, then one token a step
    assert steps_if_every_draft_checked(prompt, output, 0, 2, 3) == 7
    assert makespan([7, 3, 2, 4], 2) == 9  # slot 0: 7; slot 1: 3, 2, 4
    # B=1: 14 steps -> 4 + 7; B=2: the unhelped request bounds it (7 steps either way)
    assert ceiling_speedup([prompt, [5]], [output, list(range(7))], 4, 2, 3, 1) == 14 / 11
    assert ceiling_speedup([prompt, [5]], [output, list(range(7))], 4, 2, 3, 2) == 1.0


def measured(gate: DraftGate, plain: float, verify: dict[int, float]) -> DraftGate:
    """`gate` after enough plain steps of `plain` seconds and verify steps of `verify[lanes]` seconds."""
    for _ in range(GATE_MIN_STEPS + 1):
        gate.record("plain", plain)
        for lanes, seconds in verify.items():
            gate.record(lanes, seconds)
    return gate


LANES_FOR_8 = EngineConfig(batch_size=8, speculative_tokens=4).verify_lanes_for  # 1, 4, 8 lanes


def test_the_gate_measures_plain_steps_then_one_lane_before_it_weighs_drafts():
    gate = DraftGate()
    assert gate.choose(8, [(3, 2.0), (5, 1.0)], LANES_FOR_8) == []  # plain steps not measured yet
    measured(gate, 1.0, {})
    assert gate.choose(8, [(3, 2.0), (5, 1.0)], LANES_FOR_8) == [3]  # one lane, the cheapest shape to measure
    assert gate.choose(8, [(3, 0.0)], LANES_FOR_8) == []  # nothing to gain there


def test_the_gate_checks_the_drafts_that_pay_for_their_rows():
    gate = measured(DraftGate(), 1.0, {1: 1.25, 4: 2.0})  # one verify lane costs a quarter of a plain step
    assert gate.choose(1, [(0, 1.0)], LANES_FOR_8) == [0]  # 2 tokens for 1.25 steps
    assert gate.choose(1, [(0, 0.3)], LANES_FOR_8) == []  # 1.3 tokens for 1.25 steps: within GATE_MARGIN
    assert gate.choose(8, [(3, 1.5), (5, 1.5)], LANES_FOR_8) == []  # 8 busy slots: 9.5 / 1.25 and 11 / 2 < 8
    gate = measured(DraftGate(), 1.0, {1: 1.05})
    # 4 lanes, not measured: 1 + 0.05 * 4 (linear in lanes from 1), 10 tokens for 1.2 steps; 9.5 for 1.05 pays
    assert gate.choose(8, [(3, 1.5), (5, 0.5)], LANES_FOR_8) == [3]
    measured(gate, 1.0, {4: 1.15})  # measured: cheaper than that guess
    assert gate.choose(8, [(3, 1.5), (5, 1.5)], LANES_FOR_8) == [3, 5]  # 11 / 1.15 > 9.5 / 1.05
    assert gate.choose(8, [(3, 1.5), (5, 1.5), (6, 0.1)], LANES_FOR_8) == [3, 5, 6]  # the same 4 lanes
    assert gate.choose(8, [(3, 1.5), (5, 0.5)], LANES_FOR_8) == [3]  # 10 / 1.15 < 9.5 / 1.05


def test_expected_accepted_drafts_follow_each_request_and_recover_while_unchecked():
    acceptance = Acceptance()
    assert acceptance.expected("a", 4) == PRIOR_ACCEPTED and acceptance.expected("a", 0) == 0  # at most the draft
    for _ in range(20):
        acceptance.record("a", 4)
        acceptance.record("b", 0)
    assert acceptance.expected("a", 4) > 3.5 and acceptance.expected("b", 4) < 0.1
    assert 1.5 < acceptance.overall < 2.5
    assert acceptance.expected("c", 4) == acceptance.overall  # a new request starts from every request's average
    for _ in range(20):
        acceptance.unchecked("b")
    assert acceptance.expected("b", 4) == pytest.approx(acceptance.overall, abs=0.05)  # tried again once it pays
    for _ in range(40):
        acceptance.record("b", 0)
    assert acceptance.overall < 0.1
    assert acceptance.expected("d", 4) == PRIOR_ACCEPTED  # never below one accepted draft: new requests are tried
    acceptance.finished("b")
    assert acceptance.expected("b", 4) == PRIOR_ACCEPTED


def _decoding(prompt, output, max_new_tokens, slot=0):
    request = Request(slot, prompt, SamplingParams(max_new_tokens=max_new_tokens), seed=0)
    request.output_ids, request.num_cached, request.slot = list(output), len(prompt) + len(output) - 1, slot
    return SlotWork(slot, request, output[-1:], request.num_cached, samples=True)


def test_drafts_fit_the_request_and_the_cache_and_only_decoding_steps_verify():
    config = EngineConfig(batch_size=2, max_seq_length=32, prefill_chunk=8, speculative_tokens=4)
    drafter = Drafter(config)
    measured(drafter.gate, 1.0, {1: 1.0, 2: 1.0})  # verify steps as cheap as plain ones: every draft is checked
    loop = [1, 2, 3] * 3
    plan = drafter.propose(StepPlan([_decoding(loop, [1, 2], 20), _decoding([5, 6, 7], [8], 20, slot=1)]))
    assert plan.verify and [w.draft for w in plan.work] == [[3, 1, 2], []]  # what followed [3, 1, 2] last time
    assert plan.work[0].token_ids == [2, 3, 1, 2] and plan.work[0].lane == 0 and plan.work[1].lane is None
    assert drafter.propose(StepPlan([_decoding(loop, [1, 2], 4)])).work[0].draft == [3]  # 2 tokens left: 1 draft
    near_end = _decoding(loop * 3 + [1, 2], [3], 20)  # fed at position 29 of 32: room for 2
    assert drafter.propose(StepPlan([near_end])).work[0].draft == [1, 2]
    prefilling = dataclasses.replace(_decoding([4] * 12, [], 20, slot=1), token_ids=[4] * 8, start_pos=0, lane=0)
    assert not drafter.propose(StepPlan([_decoding(loop, [1, 2], 20), prefilling])).verify  # a prefill lane


# -- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(speculative_tokens=-1), "speculative_tokens", ">= 0"),
        (dict(speculative_tokens=True), "speculative_tokens", "int"),
        (dict(speculative_tokens=8, prefill_chunk=8), "speculative_tokens", "< prefill_chunk (8)"),
        (dict(speculative_tokens=4, speculative_ngram_min=0), "speculative_ngram_min", ">= 1"),
        (dict(speculative_tokens=4, speculative_ngram_min=3, speculative_ngram_max=2), "speculative_ngram_max", ">= 3"),
    ],
)
def test_bad_speculative_settings_are_refused_with_the_limit(fields, param, words):
    with pytest.raises(ParamError, match=re.escape(words)) as error:
        EngineConfig(**fields)
    assert error.value.param == param


def test_verify_shapes_are_listed_with_the_others():
    config = EngineConfig(batch_size=8, max_seq_length=512, speculative_tokens=4)
    assert config.verify_lane_counts == (1, 4, 8)
    verify = [s for s in config.step_shapes if s.verify]
    assert verify == [StepShape(c, length, True) for c in (1, 4, 8) for length in (256, 512)]
    assert config.step_rows(4, verify=True) == 8 + 4 * 5
    assert verify[0].describe(config) == "1x5 verify + 8 decode rows, attend 256"
    assert not any(s.verify for s in EngineConfig(batch_size=8).step_shapes)  # off by default


# -- outputs identical to plain decoding -------------------------------------------------------
@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt("llama")


def checking_every_draft(engine: Engine) -> Engine:
    """`engine` with a gate that finds verify steps as cheap as plain ones and records no step times:
    every draft is checked, whatever this machine's timings (the gate's own tests are above)."""
    gate = measured(DraftGate(), 1.0, {lanes: 1.0 for lanes in engine.config.verify_lane_counts})
    gate.record = lambda kind, seconds: None
    engine.drafter.gate = gate
    return engine


def run(gpt, k: int, params, prompts=PROMPTS, compile="eager", **overrides):
    engine = Engine(gpt, EngineConfig(compile=compile, speculative_tokens=k, **dict(CONFIG, **overrides)))
    if k:
        checking_every_draft(engine)
    return engine, engine.generate(prompts, params)


def assert_same(plain, spec):
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        assert [[t for t, _ in top] for top in b.top_logprobs] == [[t for t, _ in top] for top in a.top_logprobs]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=40),
        SamplingParams(max_new_tokens=40, temperature=0.3, seed=7),
        SamplingParams(max_new_tokens=40, temperature=0.5, top_k=20, top_p=0.9, seed=11, logprobs=3),
    ],
    ids=["greedy", "seeded", "filtered-with-logprobs"],
)
def test_outputs_are_those_of_plain_decoding_with_drafts_accepted_and_rejected(gpt, params):
    _, plain = run(gpt, 0, params)
    engine, spec = run(gpt, 4, params)
    assert_same(plain, spec)
    stats = engine.stats()["speculative"]
    assert stats["verify_steps"] > 0
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # some drafts stood, some did not
    assert engine.stats()["steps"] < len(PROMPTS) * 40 / CONFIG["batch_size"] + 20  # more than a token a step


def test_stops_eos_and_max_tokens_end_where_plain_decoding_does(gpt):
    _, reference = run(gpt, 0, SamplingParams(max_new_tokens=40))
    looping = max(reference, key=lambda r: len(r.token_ids) - len(set(r.token_ids)))  # drafts get accepted here
    out = looping.token_ids
    cases = [
        SamplingParams(max_new_tokens=13),
        SamplingParams(max_new_tokens=40, stop_token_ids=[out[17]]),
        SamplingParams(max_new_tokens=40, stop=[out[20:23]]),
    ]
    for params in cases:
        _, plain = run(gpt, 0, params, prompts=[looping.prompt_ids] * 2)
        _, spec = run(gpt, 4, params, prompts=[looping.prompt_ids] * 2)
        assert_same(plain, spec)
    plain_engine = Engine(gpt, EngineConfig(compile="eager", **CONFIG))
    spec_engine = checking_every_draft(Engine(gpt, EngineConfig(compile="eager", speculative_tokens=4, **CONFIG)))
    results = []
    for engine in (plain_engine, spec_engine):
        engine.eos_ids = frozenset({out[25]})
        results.append(engine.generate([looping.prompt_ids], SamplingParams(max_new_tokens=40)))
    assert_same(*results)
    assert results[1][0].finish_reason == "stop"


def test_streamed_tokens_arrive_in_order_and_kept_tokens_end_at_the_last_accepted(gpt):
    params = SamplingParams(max_new_tokens=30)
    engine = checking_every_draft(Engine(gpt, EngineConfig(compile="eager", speculative_tokens=4, **CONFIG)))
    streamed: dict = {}
    for output in engine.stream(PROMPTS, params):
        streamed.setdefault(output.request_id, []).extend(output.token_ids)
    assert engine.stats()["speculative"]["accepted_tokens"] > 0
    _, plain = run(gpt, 0, params)
    assert [streamed[i] for i in sorted(streamed)] == [r.token_ids for r in plain]
    assert all(engine.scheduler.kept)
    for kept in engine.scheduler.kept:  # each slot's last request: the entries it wrote
        request = next(r for r in plain if r.prompt_ids == kept[: len(r.prompt_ids)])
        assert kept == (request.prompt_ids + request.token_ids)[: len(kept)]
        assert len(kept) == len(request.prompt_ids) + len(request.token_ids) - 1  # the last token never fed


def test_prompt_logprobs_and_mixed_arrivals_are_unchanged(gpt):
    params = [SamplingParams(max_new_tokens=20, prompt_logprobs=2), SamplingParams(max_new_tokens=25)] * 4
    prompts = PROMPTS
    plain = Engine(gpt, EngineConfig(compile="eager", **CONFIG)).generate(prompts, params)
    spec_engine = checking_every_draft(Engine(gpt, EngineConfig(compile="eager", speculative_tokens=3, **CONFIG)))
    spec = spec_engine.generate(prompts, params)
    assert_same(plain, spec)
    for a, b in zip(plain, spec):
        assert b.prompt_logprobs[1:] == pytest.approx(a.prompt_logprobs[1:], abs=1e-4)


def test_thunder_makes_each_shape_once_and_matches_eager(gpt):
    config = dict(batch_size=1, max_seq_length=64, prefill_chunk=8, prefill_lanes=0)
    prompts = PROMPTS[-3:]
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=30, temperature=0.3, seed=3)]
    engine = checking_every_draft(Engine(gpt, EngineConfig(compile="thunder", speculative_tokens=3, **config)))
    engine.warmup()
    assert engine.stats()["cache_misses"] == len(engine.config.step_shapes) == 2  # decode, 1 verify lane
    for p in params:
        spec = engine.generate(prompts, p)
        plain = Engine(gpt, EngineConfig(compile="eager", **config)).generate(prompts, p)
        assert_same(plain, spec)
    stats = engine.stats()
    assert stats["speculative"]["accepted_tokens"] > 0
    assert stats["cache_misses"] == 2 and stats["thunder_traces"] == stats["traced"]
    # On CPU a verify block's attention is the executor's one op (each row over its own slot's cache)
    traces = [str(t) for t in execution_traces(engine.runner.verify_fn)]
    assert any("= thunder_batch_slot_rows_attention(" in t for t in traces)
    assert not any("scaled_dot_product_attention" in t for t in traces)


@pytest.mark.parametrize("family,overrides", [("gemma2_window", dict(attention_logit_softcapping=None))])
def test_thunder_verify_steps_on_sliding_window_layers_match_plain_decoding(family, overrides):
    """A verify step's one attention op on layers that alternate sliding-window and global masks (each
    layer picks its mask kind): greedy tokens, logprobs and alternatives those of eager k = 0."""
    gpt = tiny_gpt(family, **overrides)
    config = dict(batch_size=4, max_seq_length=64, prefill_chunk=8)
    params = SamplingParams(max_new_tokens=24, logprobs=2)
    engine = checking_every_draft(Engine(gpt, EngineConfig(compile="thunder", speculative_tokens=3, **config)))
    spec = engine.generate(PROMPTS, params)
    assert_same(Engine(gpt, EngineConfig(compile="eager", **config)).generate(PROMPTS, params), spec)
    counts = engine.stats()["speculative"]
    assert 0 < counts["accepted_tokens"] < counts["draft_tokens"]  # drafts both accepted and rejected
    assert any("= thunder_batch_slot_rows_attention(" in str(t) for t in execution_traces(engine.runner.verify_fn))


PASSAGE = (
    "The old lighthouse on Marrow Point was switched off in 1987, but the keepers' cottage still stands beside "
    "it. Every spring a group of volunteers repaints the door, clears the gutters and checks the small weather "
    "station on the roof. The station sends wind speed and air pressure to the harbour office every ten minutes."
)


RUNS = {
    "greedy": SamplingParams(max_new_tokens=48),
    "seeded": SamplingParams(max_new_tokens=48, temperature=0.8, seed=123),
    "stop string": SamplingParams(max_new_tokens=48, stop=["weather"]),
}


@pytest.mark.slow
def test_real_model_copying_a_passage_gives_the_same_tokens_with_fewer_steps():
    """The default checkpoint, eager fp32, B = 1: a chat asking to copy a passage, greedy, seeded, and
    greedy with a stop string that the copy reaches inside a verify step's accepted tokens."""
    from thunder_batch.checkpoints import default_checkpoint_dir

    prompt = [dict(role="user", content=f"Repeat the following passage word for word.\n\n{PASSAGE}")]
    config = dict(batch_size=1, max_seq_length=256, prefill_chunk=64, compile="eager")
    outputs = {}
    for k in (0, 4):
        engine = Engine.from_checkpoint(default_checkpoint_dir(), EngineConfig(speculative_tokens=k, **config))
        for name, params in RUNS.items():
            before = engine.stats()["steps"]
            [result] = engine.generate([prompt], params)
            outputs[k, name] = (result.token_ids, result.text, result.finish_reason, engine.stats()["steps"] - before)
        if k:
            assert engine.stats()["speculative"]["accepted_tokens"] > 0
    for name in RUNS:
        assert outputs[4, name][:3] == outputs[0, name][:3]  # tokens, text, finish reason
    assert outputs[0, "stop string"][1].endswith("small ") and outputs[0, "stop string"][2] == "stop"
    assert outputs[4, "greedy"][3] < outputs[0, "greedy"][3]  # the copy's drafts stand: fewer steps
