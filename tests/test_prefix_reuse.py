"""Prompt prefixes read once: a slot's kept cache reused in place by the next prompt sharing its prefix,
or copied into another slot; the tokens are those of litgpt's generate_fn and of the engine without reuse."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.request import Request
from thunder_batch.scheduler import Scheduler, common_prefix
from thunder_batch.step_plan import PrefixCopy, PrefixRestore, PrefixSave

from helpers import litgpt_greedy, tiny_gpt

CONFIG = dict(batch_size=2, max_seq_length=128, prefill_chunk=8)


def engine_for(gpt, reuse: bool = True, compile: str = "eager", **overrides) -> Engine:
    return Engine(gpt, EngineConfig(compile=compile, prefix_reuse=reuse, **{**CONFIG, **overrides}))


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def conversation(engine: Engine, turns: int = 4, new: int = 10, out: int = 6, params=None) -> list[list[int]]:
    """Each turn sends the whole conversation so far, its reply and `new` more token ids."""
    rng, prompt, prompts = random.Random(0), [], []
    params = params or SamplingParams(max_new_tokens=out)
    for _ in range(turns):
        prompt = prompt + ids(rng, new)
        prompts.append(prompt)
        prompt = prompt + engine.generate([prompt], params)[0].token_ids
    return prompts, prompt


def shared_prefix_prompts(n: int = 6, prefix: int = 20) -> list[list[int]]:
    rng = random.Random(1)
    system = ids(rng, prefix)
    return [system + ids(rng, rng.randint(1, 6)) for _ in range(n)]


def test_multi_turn_tokens_equal_litgpt_and_no_reuse_and_only_new_tokens_are_computed():
    gpt = tiny_gpt("llama")
    on, off = engine_for(gpt), engine_for(gpt, reuse=False)
    prompts, transcript = conversation(on)
    assert conversation(off)[1] == transcript
    for prompt in prompts:  # every reply is litgpt's for its whole prompt alone
        reply = transcript[len(prompt) : len(prompt) + 6]
        assert reply == litgpt_greedy(gpt, prompt, 6)
    stats = on.stats()
    # Turn t+1 reuses turn t's prompt and reply but the reply's last token (sampled, never fed).
    reused = sum(len(p) + 6 - 1 for p in prompts[:-1])
    assert stats["prompt_tokens_reused"] == reused
    assert stats["prompt_tokens"] == stats["prompt_tokens_looked_up"] == sum(len(p) for p in prompts)
    assert stats["prompt_tokens_computed"] == stats["prompt_tokens"] - reused
    assert off.stats()["prompt_tokens"] == off.stats()["prompt_tokens_computed"] == stats["prompt_tokens"]
    assert off.stats()["prompt_tokens_reused"] == 0 and stats["steps"] < off.stats()["steps"]


def test_shared_prefix_burst_reads_the_prefix_once_and_matches_litgpt():
    """Six prompts sharing 20 tokens, submitted at once into 3 slots: the first reads the shared part,
    the others wait for it and copy it (or reuse it in place), so only unique tokens are computed."""
    gpt = tiny_gpt("pythia")
    prompts = shared_prefix_prompts()
    engine = engine_for(gpt, batch_size=3, prefix_copy_min=4)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.token_ids for r in results] == [litgpt_greedy(gpt, p, 5) for p in prompts]
    off = engine_for(gpt, reuse=False, batch_size=3).generate(prompts, SamplingParams(max_new_tokens=5))
    assert [r.token_ids for r in off] == [r.token_ids for r in results]
    stats = engine.stats()
    unique = 20 + sum(len(p) - 20 for p in prompts)
    assert stats["prompt_tokens_computed"] == unique
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts)


def test_copy_from_a_busy_slot_below_the_threshold_is_not_made():
    gpt = tiny_gpt("llama")
    prompts = shared_prefix_prompts(n=2, prefix=20)
    engine = engine_for(gpt, prefix_copy_min=21)  # the shared 20 tokens are not worth a copy
    results = engine.generate(prompts, SamplingParams(max_new_tokens=4))
    assert [r.token_ids for r in results] == [litgpt_greedy(gpt, p, 4) for p in prompts]
    assert engine.stats()["prompt_tokens_reused"] == 0


def test_seeded_sampling_is_the_same_with_and_without_reuse():
    gpt = tiny_gpt("llama")
    params = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=50, seed=1234)
    with_reuse = conversation(engine_for(gpt), params=params)[1]
    assert with_reuse == conversation(engine_for(gpt, reuse=False), params=params)[1]
    prompts = shared_prefix_prompts()
    seeded = [SamplingParams(max_new_tokens=5, temperature=0.8, seed=s) for s in range(len(prompts))]
    on = engine_for(gpt, batch_size=3, prefix_copy_min=4).generate(prompts, seeded)
    off = engine_for(gpt, reuse=False, batch_size=3).generate(prompts, seeded)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]


def test_prompt_logprobs_requests_feed_every_prompt_token():
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt)
    prompt = list(range(3, 20))
    engine.generate([prompt], SamplingParams(max_new_tokens=3))
    scored = engine.generate([prompt], SamplingParams(max_new_tokens=3, prompt_logprobs=0))[0]
    alone = engine_for(gpt, reuse=False).generate([prompt], SamplingParams(max_new_tokens=3, prompt_logprobs=0))[0]
    assert scored.prompt_logprobs == alone.prompt_logprobs and len(scored.prompt_logprobs) == len(prompt)
    assert engine.stats()["prompt_tokens_reused"] == 0


def reused_after(engine: Engine, prompt: list[int]) -> int:
    before = engine.stats()["prompt_tokens_reused"]
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    return engine.stats()["prompt_tokens_reused"] - before


def test_kept_tokens_are_dropped_after_abort_reset_and_a_failed_step():
    """A slot's kept tokens alone (the host store, which would give back the first request's entries
    saved before the aborted one wrote over them, has its own test)."""
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt, batch_size=1, prefix_store_mb=0)
    prompt = list(range(1, 30))
    engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert reused_after(engine, prompt) == len(prompt) - 1  # kept: the same prompt feeds its last token only

    engine.reset_prefix_cache()
    assert engine.scheduler.kept == [[]] and reused_after(engine, prompt) == 0

    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=5))
    engine.step()
    engine.abort(request_id)
    assert engine.scheduler.kept == [[]] and reused_after(engine, prompt) == 0

    run = engine.runner.step_fn

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.step_fn = failing
    engine.add_request(prompt + [5, 6], SamplingParams(max_new_tokens=2), request_id="x")
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.runner.step_fn = run
    engine.abort("x")
    assert engine.scheduler.kept == [[]] and reused_after(engine, prompt) == 0
    assert engine.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids == litgpt_greedy(gpt, prompt, 4)


def test_an_edit_of_the_weights_drops_every_kept_prefix():
    """Kept entries were computed by the weights of their time: an in-place edit (or a new tensor) makes
    the next step forget them, so the same prompt again is computed afresh and gives the new weights' tokens."""
    gpt = tiny_gpt("llama")
    engine, prompt = engine_for(gpt), list(range(3, 23))
    engine.generate([prompt], SamplingParams(max_new_tokens=4))
    with torch.no_grad():
        gpt.transformer.h[0].attn.proj.weight.mul_(-1)  # in place: the same tensor, a new version
    reused = engine.stats()["prompt_tokens_reused"]
    again = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert engine.stats()["prompt_tokens_reused"] == reused
    assert again[0].token_ids == litgpt_greedy(gpt, prompt, 4)


def test_a_failed_step_undoes_its_copies_and_the_request_computes_them():
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt, prefix_copy_min=4)
    system = list(range(1, 21))
    holder = engine.add_request(system + [40, 41], SamplingParams(max_new_tokens=20))
    engine.step()
    while engine.scheduler.slots[0].num_cached < 22:
        engine.step()
    build = engine.runner.inputs_for
    engine.runner.inputs_for = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # after the copy
    copier = engine.add_request(system + [50], SamplingParams(max_new_tokens=3))
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.scheduler.slots[1].num_cached == 0  # its copy was undone with the failed step
    assert engine.stats()["prompt_tokens_reused"] == 0
    engine.runner.inputs_for = build
    with_copy = engine.stats()["prompt_tokens_computed"]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.find(copier) is None and engine.scheduler.find(holder) is None
    assert engine.scheduler.kept == [[], []]  # both were busy when the step failed
    assert engine.stats()["prompt_tokens_computed"] == with_copy + 21 and engine.stats()["prompt_tokens_reused"] == 0


def request(prompt, **params) -> Request:
    return Request(id(prompt), prompt, SamplingParams(**params), 0)


def finish(scheduler: Scheduler, r: Request, output: list[int]) -> None:
    r.output_ids = list(output)
    r.num_cached = len(r.prompt_ids) + len(output) - 1
    scheduler.remove(r)


def test_admission_takes_the_longest_kept_prefix_then_the_least_recently_used_slot():
    scheduler = Scheduler(3, chunk=4, lane_counts=(1,), prefix_reuse=True, copy_min=100)
    first = [request([1, 2, 3, 4, 5]), request([9, 9, 9]), request([7, 7])]
    for r in first:
        scheduler.add(r)
    scheduler.schedule()
    assert [r.slot for r in first] == [0, 1, 2]
    for r, out in zip([first[2], first[0], first[1]], [[8], [6, 6], [1]]):  # freed: slot 2, then 0, then 1
        finish(scheduler, r, out)
    assert scheduler.kept == [[1, 2, 3, 4, 5, 6], [9, 9, 9], [7, 7]]
    matching, fresh = request([1, 2, 3, 4, 5, 6, 6, 0]), request([4, 4])
    scheduler.add(matching)
    scheduler.add(fresh)
    plan = scheduler.schedule()
    assert matching.slot == 0 and matching.num_cached == 6  # fed from position 6, in place
    assert fresh.slot == 2  # no match: the least recently freed slot (2), not the lowest free one (1)
    assert [(w.slot, w.start_pos, w.token_ids) for w in plan.work if w.slot == 0] == [(0, 6, [6, 0])]
    assert plan.copies == ()


def test_a_whole_kept_prompt_still_feeds_its_last_token_and_copies_follow_the_threshold():
    scheduler = Scheduler(2, chunk=4, lane_counts=(1,), prefix_reuse=True, copy_min=3)
    held = request([5, 6, 7, 8, 9])
    scheduler.add(held)
    scheduler.schedule()
    held.num_cached = 5  # busy, its prompt cached
    same = request([5, 6, 7, 8, 9])
    scheduler.add(same)
    plan = scheduler.schedule()
    assert plan.copies == (PrefixCopy(0, 1, 0, 4),) and same.num_cached == 4
    assert [w.token_ids for w in plan.work if w.slot == 1] == [[9]]


def test_common_prefix_is_capped_and_exact_across_blocks():
    a = list(range(200))
    assert common_prefix(a, a, 150) == 150 and common_prefix(a, a[:130] + [0], 999) == 130
    assert common_prefix(a, [], 5) == 0 and common_prefix([1, 2], [1, 3], 5) == 1


def workloads(engine: Engine) -> list[list[int]]:
    """A 3-turn conversation, then four prompts sharing 20 tokens (greedy and seeded sampling)."""
    tokens = [conversation(engine, turns=3, new=8, out=5)[1]]
    prompts = shared_prefix_prompts(n=4)
    params = [SamplingParams(max_new_tokens=5, temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    return tokens + [r.token_ids for r in engine.generate(prompts, params)]


def test_thunder_in_place_writes_and_recorded_graphs_see_the_copied_entries(tmp_path):
    """Under Thunder (cache written in place) and then under recorded CUDA graphs (test_cuda_graphs'
    CPU stand-in, replaying the captured ops on the same buffers), copies and reuse give the tokens of
    the eager engine without reuse, and no step shape is made beyond the config's."""
    from test_cuda_graphs import with_recorded_graphs

    shape = dict(batch_size=2, max_seq_length=64, prefill_chunk=8, prefix_copy_min=4)
    want = workloads(engine_for(tiny_gpt("llama", n_layer=1), reuse=False, **shape))
    config = dict(shape, cache_dir=str(tmp_path))
    thunder = engine_for(tiny_gpt("llama", n_layer=1), compile="thunder", **config)
    thunder.warmup()
    misses = thunder.stats()["cache_misses"]
    assert workloads(thunder) == want
    stats = thunder.stats()
    assert stats["cache_misses"] == misses == len(thunder.config.step_shapes) and stats["prompt_tokens_reused"] > 60
    graphed = engine_for(tiny_gpt("llama", n_layer=1), compile="thunder", **config)
    graphs, _ = with_recorded_graphs(graphed)
    assert workloads(graphed) == want and graphs.replays > 20
    assert graphed.stats()["prompt_tokens_reused"] == stats["prompt_tokens_reused"]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 6),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(1, 14), st.integers(1, 4)), max_size=10),
    st.sampled_from([0, 12, 40, 1000]),
)
def test_random_traffic_every_fed_token_sees_its_own_tokens_before_it(num_slots, chunk, copy_min, arrivals, store):
    """A model of the caches (token id per slot and position, and per stored prefix) under random prompts
    drawn from a few shared stems, finished and aborted requests, copies, saves, restores and reuse, with
    a host store of `store` tokens: every token is fed at a position whose entries before it hold exactly
    its request's tokens, a restore reads only entries still stored, and every request gets all its tokens."""
    s = Scheduler(num_slots, chunk, (1,) if chunk > 1 else (), prefix_reuse=True, copy_min=copy_min, store_tokens=store)
    stems = [[7] * 20, list(range(20)), [7] * 5 + list(range(15))]
    cache = [dict() for _ in range(num_slots)]  # slot -> {position: token id}
    stored = {}  # stored prefix -> {position: token id}
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])
    live = {}
    for step in range(300):
        while pending and pending[0][1][0] <= step:
            rid, (_, stem, length, new) = pending.pop(0)
            prompt = (stems[stem % 3] + [50 + rid] * 20)[:length] if stem < 3 else [60 + rid] * length
            live[rid] = Request(rid, prompt, SamplingParams(max_new_tokens=new), 0)
            s.add(live[rid])
        victims = [r for r in live.values() if r.slot is not None and r.request_id % 3 == 0]
        if step % 5 == 4 and victims:
            s.remove(victims[0], keep=False)
            victims[0].finish_reason = "abort"
        plan = s.schedule()
        if plan is None:
            if not pending:
                break
            continue
        for c in plan.copies:
            if isinstance(c, PrefixSave):
                stored[c.entry] = {p: cache[c.src][p] for p in range(c.end)}
            else:
                source = stored[c.entry] if isinstance(c, PrefixRestore) else cache[c.src]
                cache[c.dst].update({p: source[p] for p in range(c.start, c.end)})
        for entry in plan.dropped:
            del stored[entry]
        assert store or not stored
        for w in plan.work:
            known = w.request.prompt_ids + w.request.output_ids
            assert [cache[w.slot].get(p) for p in range(w.start_pos)] == known[: w.start_pos]
            cache[w.slot].update(zip(range(w.start_pos, w.start_pos + len(w.token_ids)), w.token_ids))
            s.postprocess(w, [(200 + len(w.request.output_ids), 0.0, None)] if w.samples else [])
    assert not s.has_unfinished() and not pending
    for r in live.values():
        assert r.finish_reason == "abort" or len(r.output_ids) == r.params.max_new_tokens


def test_metrics_count_prefix_cache_queries_and_hits_in_tokens():
    """The server's worker exports the engine's lookups and hits as vLLM's counters (tokens)."""
    pytest.importorskip("litserve")
    from test_server_worker import add, greedy, payload, run_all, tiny_api

    api = tiny_api()
    for uid, prompt in [("a", [1, 2, 3, 4, 5, 6]), ("b", [1, 2, 3, 4, 5, 6, 7, 8])]:  # one after the other
        add(api, [(uid, payload(prompt, params=greedy(3)))])
        run_all(api)
    text = api.metrics.render().decode()
    # a keeps [1..6] and the 2 outputs it fed; b shares its first 6 tokens with them
    assert 'thunder_batch:prefix_cache_queries_total{model_name="tiny"} 14.0' in text
    assert 'thunder_batch:prefix_cache_hits_total{model_name="tiny"} 6.0' in text


def test_prefix_bench_compares_reuse_off_and_on_on_the_same_tokens(tmp_path):
    """`bench --dataset multi-turn / shared-prefix` on a tiny model: equal tokens, the engine's counters,
    and a control sharing nothing that reuse leaves as it was (same steps, same tokens computed)."""
    import json
    from dataclasses import replace

    from thunder_batch.bench.options import BenchOptions
    from thunder_batch.bench.prefix_run import run_prefix_benchmark

    gpt = tiny_gpt("llama")
    common = BenchOptions(max_new_tokens=5, batch_size="3", systems="eager,litgpt-batched", turns=4, prefill_chunk=8)
    multi = run_prefix_benchmark(gpt, None, replace(common, dataset="multi-turn", num_requests=2, input_len=6))
    [(name, by_workload)] = multi["results"].items()
    turn = by_workload["multi-turn"]
    assert name == "eager" and turn["tokens_equal"] and len(turn["ttft_by_turn_s"][1]) == 4
    # 2 conversations, turn t's prompt is 11t - 5 tokens; all but the first turn's reuse 11(t-1) - 1 of them
    assert turn["prompt_tokens_computed"] == (2 * sum(11 * t - 5 for t in range(1, 5)), 2 * (6 + 3 * 7))
    out = tmp_path / "shared.json"
    shared = replace(common, dataset="shared-prefix", num_requests=6, input_len=20, output_json=out)
    result = run_prefix_benchmark(gpt, None, shared)["results"]["eager"]
    assert result["shared-prefix"]["tokens_equal"] and result["shared-prefix"]["computed_over_unique"] == 1.0
    assert result["shared-prefix"]["unique_tokens"] == 20 + 6 * 40
    control = result["control"]
    assert control["tokens_equal"] and control["steps"][0] == control["steps"][1] and control["same_plans"]
    assert not result["shared-prefix"]["same_plans"]
    assert control["prompt_tokens_computed"] == (6 * 60, 6 * 60) and control["prompt_tokens_reused"] == 0
    assert json.loads(out.read_text())["results"]["eager"]["shared-prefix"]["tokens_equal"]


def test_switch_and_threshold_are_validated_and_reach_the_engine():
    from thunder_batch.cli.options import EngineOptions
    from thunder_batch.config import ParamError

    assert EngineConfig().prefix_reuse is True and EngineConfig().prefix_copy_min == 1
    assert EngineOptions(prefix_reuse=False).engine_config().prefix_reuse is False
    with pytest.raises(ParamError, match="prefix_reuse must be True or False"):
        EngineConfig(prefix_reuse="yes")
    with pytest.raises(ParamError, match="prefix_copy_min must be an int >= 1"):
        EngineConfig(prefix_copy_min=0)
    engine = engine_for(tiny_gpt("llama"), reuse=False)
    prompt = list(range(1, 20))
    engine.generate([prompt, prompt], SamplingParams(max_new_tokens=2))
    assert engine.scheduler.kept == [[], []] and engine.stats()["prompt_tokens_computed"] == 38


def test_plans_compare_across_repeats_by_request_order():
    from thunder_batch.bench.prefix import numbered_from_zero

    assert numbered_from_zero([[(7, 0, 8), (8, 0, 8)], [(7, 8, 1)]]) == [[(0, 0, 8), (1, 0, 8)], [(0, 8, 1)]]
    assert numbered_from_zero([[(9, 0, 8)], [(8, 0, 8)]]) != numbered_from_zero([[(8, 0, 8)], [(9, 0, 8)]])
