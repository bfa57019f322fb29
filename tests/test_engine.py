"""Engine behaviour: continuous batching, chunked prefill beside decode, stops, abort, stream, bad input."""

from __future__ import annotations

import pytest

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.config import ContextLengthError, ParamError

from helpers import ENGINE_CONFIG, litgpt_greedy, mixed_prompts, tiny_gpt


def engine_for(gpt=None, **overrides) -> Engine:
    return Engine(gpt or tiny_gpt("llama"), EngineConfig(compile="eager", **{**ENGINE_CONFIG, **overrides}))


def test_finished_slot_takes_next_waiting_request_at_next_step():
    engine = engine_for(batch_size=2)
    short = SamplingParams(max_new_tokens=1)
    ids = [
        engine.add_request([1, 2, 3], short),
        engine.add_request([4, 5], SamplingParams(max_new_tokens=3)),
        engine.add_request([6], SamplingParams(max_new_tokens=3)),
    ]
    assert [o.request_id for o in engine.step()] == [ids[0], ids[1]]  # both prefilled, first done
    assert engine.scheduler.slots[0] is None and list(engine.scheduler.waiting)[0].request_id == ids[2]
    engine.step()
    assert engine.scheduler.slots[0].request_id == ids[2]  # joined slot 0 on the very next step


def test_decoding_slots_advance_every_step_while_another_prefills():
    """While a 29-token prompt is read in chunks of 8 (4 steps), the decoding request gets its next
    token on every step, and every token of both is litgpt's generate_fn's for that prompt alone."""
    engine = engine_for()
    decoding = engine.add_request([3, 4], SamplingParams(max_new_tokens=10))
    tokens = {decoding: [t for o in engine.step() for t in o.token_ids]}
    prompt = list(range(1, 30))
    prefilling = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    tokens[prefilling] = []
    for step in range(4):
        outputs = {o.request_id: o.token_ids for o in engine.step()}
        assert len(outputs[decoding]) == 1 and (prefilling in outputs) == (step == 3)  # its last chunk samples
        for request_id, ids in outputs.items():
            tokens[request_id] += ids
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
    oracle = tiny_gpt("llama")
    assert tokens == {decoding: litgpt_greedy(oracle, [3, 4], 10), prefilling: litgpt_greedy(oracle, prompt, 2)}


def test_more_prompts_than_slots_all_match_litgpt():
    gpt = tiny_gpt("pythia")
    prompts = mixed_prompts(9, [4, 1, 18])
    params = [SamplingParams(max_new_tokens=n) for n in (1, 5, 9, 2, 7, 3, 8, 4, 6)]
    results = engine_for(tiny_gpt("pythia"), batch_size=3).generate(prompts, params)
    for p, sp, r in zip(prompts, params, results):
        assert r.token_ids == litgpt_greedy(gpt, p, sp.max_new_tokens) and r.finish_reason == "length"


def greedy_tokens(prompt, n=12):
    return engine_for().generate([prompt], SamplingParams(max_new_tokens=n))[0].token_ids


def test_stop_token_ids_end_generation_and_are_not_returned():
    full = greedy_tokens([7, 7, 1])
    stop = full[5]
    result = engine_for().generate([[7, 7, 1]], SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert result.token_ids == full[: full.index(stop)] and result.finish_reason == "stop"


def test_overlapping_multi_token_stop_sequence_is_caught():
    """A stop [a, b] inside ... a, a, b ...: a single match counter restarts at the wrong place."""
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt)
    # Find a prompt whose greedy output repeats a token right before another one.
    for seed in range(200):
        prompt = mixed_prompts(1, [3], seed=seed)[0]
        full = engine.generate([prompt], SamplingParams(max_new_tokens=16))[0].token_ids
        hits = [i for i in range(1, len(full) - 1) if full[i - 1] == full[i] != full[i + 1]]
        if hits:
            break
    i = hits[0]
    stop = [full[i], full[i + 1]]
    assert full[: i + 2].count(full[i]) >= 2
    result = engine.generate([prompt], SamplingParams(max_new_tokens=16, stop=[stop]))[0]
    want = full[:i]  # cut where [a, b] first completes
    for j in range(1, i + 1):
        if full[j - 1 : j + 1] == stop:
            want = full[: j - 1]
            break
    assert result.token_ids == want and result.finish_reason == "stop"


def test_stream_holds_back_a_forming_stop_and_joins_to_generate():
    prompt = [11, 12, 13]
    full = greedy_tokens(prompt)
    stop = full[4:6]
    params = SamplingParams(max_new_tokens=12, stop=[stop])
    engine = engine_for()
    streamed = [o for o in engine.stream([prompt], params)]
    tokens = [t for o in streamed for t in o.token_ids]
    assert tokens == engine_for().generate([prompt], params)[0].token_ids == full[:4]
    assert streamed[-1].finished and streamed[-1].finish_reason == "stop"
    assert not any(o.finished for o in streamed[:-1])


def test_abort_frees_the_slot_and_leaves_others_untouched():
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt, batch_size=2)
    keep = engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=8))
    gone = engine.add_request(list(range(5, 25)), SamplingParams(max_new_tokens=8))
    tokens = [t for o in engine.step() if o.request_id == keep for t in o.token_ids]
    assert engine.abort(gone) and engine.scheduler.num_running() == 1
    assert not engine.abort(gone)
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == keep for t in o.token_ids]
    assert tokens == litgpt_greedy(gpt, [1, 2, 3, 4], 8)


def test_closing_a_stream_early_aborts_its_requests():
    engine = engine_for()
    stream = engine.stream([[1, 2], [3, 4]], SamplingParams(max_new_tokens=20))
    next(stream)
    stream.close()
    assert not engine.has_unfinished()


def test_stats_count_steps_and_tokens():
    engine = engine_for()
    engine.generate([[1, 2, 3]] * 2, SamplingParams(max_new_tokens=5))
    stats = engine.stats()
    assert stats["generated_tokens"] == 10 and stats["prompt_tokens"] == 6 and stats["steps"] == 5
    assert stats["cache_misses"] == 0 and stats["programs"] == {} and stats["traced"] == 0  # eager: nothing traced
    assert stats["step_shapes"] == [
        "4 decode rows, attend 64",
        "1x8 prefill + 4 decode rows, attend 64",
        "2x8 prefill + 4 decode rows, attend 64",
        "4x8 prefill + 4 decode rows, attend 64",
    ]


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 60, SamplingParams(max_new_tokens=5), r"exceeds max_seq_length \(64\)"),
        ([1, 999], SamplingParams(), r"\[0, 256\)"),
        ("text", SamplingParams(), "needs a tokenizer"),
        ([1.5], SamplingParams(), "list of int"),
    ],
)
def test_bad_prompts_are_rejected_at_the_door(prompt, params, message):
    engine = engine_for()
    good = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=6))
    tokens = [t for o in engine.step() for t in o.token_ids]
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    tokens += [t for _ in range(10) for o in engine.step() if o.request_id == good for t in o.token_ids]
    assert tokens == litgpt_greedy(tiny_gpt("llama"), [1, 2, 3], 6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an int >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(stop=3.5), "stop must be"),
        (dict(stop=[None]), "stop must be"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(seed=-5), "seed must be"),
    ],
)
def test_bad_sampling_params_name_the_limit(kwargs, message):
    with pytest.raises(ParamError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))  # the field, as data: the server reports it as `param`


def test_submit_returns_the_request_and_none_fills_the_cache():
    engine = engine_for()
    request = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=None))
    assert request.prompt_ids == [1, 2, 3] and request.params.max_new_tokens == 64 - 3
    assert engine.add_request([4, 5], SamplingParams(max_new_tokens=2)) != request.request_id
    with pytest.raises(ContextLengthError, match=r"\(at least 1\) exceeds max_seq_length \(64\)") as info:
        engine.submit([1] * 64, SamplingParams(max_new_tokens=None))
    assert (info.value.prompt_tokens, info.value.max_new_tokens, info.value.max_seq_length) == (64, None, 64)
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_ids) == 61 and request.finish_reason == "length"


def test_generate_validates_every_prompt_before_queueing_any():
    engine = engine_for()
    with pytest.raises(ValueError, match="exceeds max_seq_length"):
        engine.generate([[1, 2], [1] * 64], SamplingParams(max_new_tokens=4))
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "batch_size"),
        (dict(prefill_chunk=100), "prefill_chunk"),
        (dict(compile="jit"), "compile must be one of"),
        (dict(max_seq_length=1), "max_seq_length"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{**ENGINE_CONFIG, **kwargs})


def test_max_seq_length_beyond_model_context_is_refused():
    with pytest.raises(ValueError, match="block_size 128"):
        Engine(tiny_gpt("llama"), EngineConfig(max_seq_length=256, prefill_chunk=8, compile="eager"))
