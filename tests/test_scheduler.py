"""Scheduler and Request bookkeeping: pure Python, no model."""

from __future__ import annotations

from thunder_batch.config import SamplingParams
from thunder_batch.request import Request
from thunder_batch.scheduler import Scheduler, SlotWork, StepPlan


def request(rid, n_prompt, **params):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(**params), seed=0)


def advance(plan):
    for w in plan.work:
        w.request.num_cached += len(w.token_ids)


def test_prefill_chunks_then_decode_width_one():
    s = Scheduler(num_slots=2, chunk=4)
    r = request("a", 10, max_new_tokens=3)
    s.add(r)
    widths, feeds, samples = [], [], []
    for _ in range(3):
        plan = s.schedule()
        widths.append(plan.width)
        feeds.append(plan.work[0].token_ids)
        samples.append(plan.work[0].samples)
        advance(plan)
    assert widths == [4, 4, 4] and feeds == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert samples == [False, False, True]
    r.append(42, -0.1)
    plan = s.schedule()
    assert plan.width == 1 and plan.work[0].token_ids == [42] and plan.work[0].start_pos == 10


def test_fifo_admission_into_freed_slots():
    s = Scheduler(num_slots=2, chunk=4)
    reqs = [request(i, 1) for i in range(4)]
    for r in reqs:
        s.add(r)
    assert [w.request.request_id for w in s.schedule().work] == [0, 1]
    s.remove(reqs[1])
    assert [(w.slot, w.request.request_id) for w in s.schedule().work] == [(0, 0), (1, 2)]
    s.remove(reqs[3])  # still waiting: leaves the queue
    assert list(s.waiting) == [] and s.find(3) is None and s.has_unfinished()


def test_width_one_when_every_slot_has_one_pending_token():
    s = Scheduler(num_slots=3, chunk=8)
    s.add(request("one", 1))
    s.add(request("two", 1))
    plan = s.schedule()
    assert plan.width == 1 and all(w.samples for w in plan.work)


def test_token_stop_is_held_back_until_decided():
    r = Request("x", [1], SamplingParams(max_new_tokens=10, stop=[[5, 6, 7]]), seed=0)
    outs = [r.append(t, 0.0) for t in (4, 5, 6, 5, 6, 7)]
    assert [o.token_ids for o in outs] == [[4], [], [], [5, 6], [], []]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and r.output_ids == [4, 5, 6]


def test_length_releases_held_tokens():
    r = Request("x", [1], SamplingParams(max_new_tokens=2, stop=[[5, 6]]), seed=0)
    outs = [r.append(t, 0.0) for t in (3, 5)]
    assert [o.token_ids for o in outs] == [[3], [5]]  # 5 could start a stop, but the length ends it
    assert outs[-1].finish_reason == "length"


def test_eos_is_not_returned_unless_ignored():
    stops = frozenset({2})
    r = Request("x", [1], SamplingParams(max_new_tokens=5), seed=0, eos_ids=stops)
    assert r.append(2, 0.0).finish_reason == "stop" and r.output_ids == []
    r = Request("y", [1], SamplingParams(max_new_tokens=5, ignore_eos=True), seed=0, eos_ids=stops)
    assert not r.append(2, 0.0).finished and r.output_ids == [2]


def test_head_for_picks_the_cheapest_head_that_serves_every_sampling_slot():
    from thunder_batch.runner import head_for

    def work(params, samples=True):
        request = Request(0, [1, 2], params, 0, frozenset(), None)
        return SlotWork(0, request, [2], 1, samples=samples)

    greedy, temp = SamplingParams(), SamplingParams(temperature=0.8)
    top_p, top_k = SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=5)
    assert head_for(StepPlan(1, [work(greedy), work(greedy)])) == "greedy"
    assert head_for(StepPlan(4, [work(greedy), work(top_p, samples=False)])) == "greedy"  # still prefilling
    assert head_for(StepPlan(1, [work(greedy), work(temp)])) == "unfiltered"
    assert head_for(StepPlan(1, [work(temp), work(top_p)])) == "filtered"
    assert head_for(StepPlan(1, [work(top_k)])) == "filtered"
    assert head_for(StepPlan(1, [work(SamplingParams(top_k=5, top_p=0.5))])) == "greedy"  # temperature 0
