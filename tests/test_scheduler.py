"""Scheduler and Request bookkeeping: pure Python, no model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from thunder_batch.config import SamplingParams
from thunder_batch.request import Request
from thunder_batch.scheduler import Scheduler
from thunder_batch.step_plan import SlotWork, StepPlan


def request(rid, n_prompt, **params):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(**params), seed=0)


def advance(s, plan):
    """After a step that sampled nothing that counts: its tokens cached (Scheduler.postprocess)."""
    for w in plan.work:
        s.postprocess(w, [])


def test_prefill_lane_chunks_then_decode_row():
    s = Scheduler(num_slots=2, chunk=4, lane_counts=(1,))
    r = request("a", 10, max_new_tokens=3)
    s.add(r)
    lanes, feeds, samples = [], [], []
    for _ in range(3):
        plan = s.schedule()
        lanes.append(plan.work[0].lane)
        feeds.append(plan.work[0].token_ids)
        samples.append(plan.work[0].samples)
        advance(s, plan)
    assert lanes == [0, 0, 0] and feeds == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert samples == [False, False, True]
    r.append(42, -0.1)
    plan = s.schedule()
    assert not plan.busy_lanes and plan.work[0].token_ids == [42] and plan.work[0].start_pos == 10
    assert plan.span == 11


def test_lanes_go_to_the_oldest_prompts_and_decode_never_pauses():
    s = Scheduler(num_slots=4, chunk=4, lane_counts=(2,))
    s.add(request("d", 1))
    run_step(s, s.schedule())  # a one-token prompt goes through its decode row
    for r in [request(i, 9) for i in range(3)]:
        s.add(r)
    plans = []
    for _ in range(4):
        plan = s.schedule()
        plans.append({w.request.request_id: (w.lane, len(w.token_ids)) for w in plan.work})
        run_step(s, plan)
    assert plans == [
        {"d": (None, 1), 0: (0, 4), 1: (1, 4)},  # the third prompt waits for a lane
        {"d": (None, 1), 0: (0, 4), 1: (1, 4)},
        {"d": (None, 1), 0: (None, 1), 1: (None, 1), 2: (0, 4)},  # a last prompt token goes by decode row
        {"d": (None, 1), 0: (None, 1), 1: (None, 1), 2: (0, 4)},
    ]


def run_step(s, plan):
    """What the engine does after a step: tokens cached, a token appended where one was sampled."""
    for w in plan.work:
        s.postprocess(w, [(50, 0.0, None)] if w.samples else [])


def test_without_lanes_prompts_go_one_token_per_step():
    s = Scheduler(num_slots=2, chunk=4, lane_counts=())
    s.add(request("a", 3))
    feeds = []
    for _ in range(3):
        plan = s.schedule()
        feeds.append((plan.work[0].token_ids, plan.work[0].samples, plan.busy_lanes))
        advance(s, plan)
    assert feeds == [([1], False, 0), ([2], False, 0), ([3], True, 0)]


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


def test_wide_steps_open_only_the_lanes_prompts_fill():
    s = Scheduler(num_slots=8, chunk=4, lane_counts=(2, 8))
    for i in range(7):
        s.add(request(i, 9))
    opened = []
    for _ in range(3):
        plan = s.schedule()
        opened.append(plan.busy_lanes)
        run_step(s, plan)
    # 7 prompts of 9 tokens: 7 < 8 lanes, so 2 lanes a step, oldest first; two lanes' last tokens go by decode row
    assert opened == [2, 2, 2]
    s = Scheduler(num_slots=8, chunk=4, lane_counts=(2, 8))
    for i in range(8):
        s.add(request(i, 9))
    assert s.schedule().busy_lanes == 8  # 8 prompts fill the wide step


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 6),
    st.sets(st.integers(1, 5), max_size=3),
    st.lists(st.tuples(st.integers(0, 6), st.integers(1, 20), st.integers(1, 5), st.booleans()), max_size=12),
)
def test_random_traffic_plans(num_slots, chunk, lane_counts, arrivals):
    """Random arrival steps, prompt and output lengths, aborts: admission is FIFO into free slots,
    every plan keeps the promises `_check_plan` lists, and every request is fed its prompt then its
    outputs, each token once, in order, until it ends."""
    lanes = tuple(sorted(c for c in lane_counts if c <= num_slots))
    s = Scheduler(num_slots, chunk, lanes)
    pending = sorted(enumerate(arrivals), key=lambda a: a[1][0])  # (id, (arrival step, prompt, new, aborted))
    age: dict = {}  # request id -> arrival order
    fed: dict = {}  # request id -> tokens fed so far, in order
    admitted, left_waiting = set(), set()
    for step in range(400):
        while pending and pending[0][1][0] <= step:
            rid, (_, n_prompt, n_new, aborted) = pending.pop(0)
            age[rid] = len(age)
            s.add(request(rid, n_prompt, max_new_tokens=n_new))
        if step % 7 == 3:  # abort the newest request that asked for it, wherever it is
            victims = [r for r in [*s.waiting, *s.slots] if r is not None and arrivals[r.request_id][3]]
            if victims:
                s.remove(victims[-1])
                if victims[-1].request_id not in admitted:
                    left_waiting.add(victims[-1].request_id)
        plan = s.schedule()
        admitted |= {r.request_id for r in s.slots if r is not None}
        _check_admission(s, age, admitted, left_waiting)
        if plan is None:
            if not pending:
                break
            continue
        _check_plan(s, plan, chunk, lanes, age, fed)
        for w in plan.work:
            fed.setdefault(w.request.request_id, []).extend(w.token_ids)
            s.postprocess(w, [(100 + len(w.request.output_ids), 0.0, None)] if w.samples else [])
    assert not s.has_unfinished() and not pending
    assert set(fed) <= admitted and all(rid in fed for rid in age if not arrivals[rid][3])
    for rid, tokens in fed.items():
        n_prompt, n_new = arrivals[rid][1], arrivals[rid][2]
        want = list(range(1, n_prompt + 1)) + [100 + i for i in range(n_new - 1)]
        assert tokens == want[: len(tokens)]
        assert arrivals[rid][3] or tokens == want  # only an aborted request stops early


def _check_admission(s: Scheduler, age: dict, admitted: set, left_waiting: set) -> None:
    """FIFO into free slots: a request waits only while every slot is taken, and no request is
    admitted while one that arrived before it still waits."""
    waiting = [rid for rid in sorted(age, key=age.get) if rid not in admitted and rid not in left_waiting]
    if waiting:
        assert all(r is not None for r in s.slots)
        assert all(age[rid] < age[waiting[0]] for rid in admitted)


def _check_plan(s: Scheduler, plan: StepPlan, chunk: int, lanes: tuple[int, ...], age: dict, fed: dict) -> None:
    """What the scheduler promises of one plan, as properties (the lane policy is not re-derived):
    - each slot at most once, with the request it holds, fed from where that request stopped (no
      token read twice or skipped); `samples` exactly when the feed reaches the end of what is known;
    - decode rows carry one token; every slot with one token left has its decode row (decode never
      pauses), and with lanes no other slot uses one;
    - lanes are numbered 0..k-1, each feeds real prompt tokens: the next chunk, or the rest of the prompt;
    - k is one of the lane counts (or every waiting prompt, when fewer wait than the smallest count),
      never more than the prompts waiting for a lane, and no wider count they would fill is left unused;
    - the lanes go to the oldest prompts (in arrival order: admission is FIFO).
    """
    assert len({w.slot for w in plan.work}) == len({w.request.request_id for w in plan.work}) == len(plan.work)
    left = {}  # request id -> tokens known but not yet fed
    for r in (r for r in s.slots if r is not None):
        left[r.request_id] = len(r.prompt_ids) + len(r.output_ids) - len(fed.get(r.request_id, ()))
    for w in plan.work:
        r = w.request
        known = r.prompt_ids + r.output_ids
        assert s.slots[w.slot] is r and w.start_pos == len(fed.get(r.request_id, ()))
        assert w.token_ids and w.token_ids == known[w.start_pos : w.start_pos + len(w.token_ids)]
        assert w.samples == (len(w.token_ids) == left[r.request_id])
    decode = [w for w in plan.work if w.lane is None]
    assert all(len(w.token_ids) == 1 for w in decode)
    assert {w.request.request_id for w in decode} == {rid for rid, n in left.items() if n == 1 or not lanes}
    in_lanes = sorted((w for w in plan.work if w.lane is not None), key=lambda w: w.lane)
    k = len(in_lanes)
    assert [w.lane for w in in_lanes] == list(range(k))
    for w in in_lanes:
        assert w.start_pos + len(w.token_ids) <= len(w.request.prompt_ids)
        assert len(w.token_ids) == min(chunk, left[w.request.request_id])
    waiting_for_lane = sorted((rid for rid, n in left.items() if n > 1 and lanes), key=age.get)
    if lanes:
        assert k <= len(waiting_for_lane) and (k > 0) == bool(waiting_for_lane)
        assert k in lanes or k == len(waiting_for_lane) < lanes[0]
        assert not [c for c in lanes if k < c <= len(waiting_for_lane)]
    assert {w.request.request_id for w in in_lanes} == set(waiting_for_lane[:k])


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
        return SlotWork(0, request, [2], 1, samples=samples, lane=None if samples else 0)

    greedy, temp = SamplingParams(), SamplingParams(temperature=0.8)
    top_p, top_k = SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.8, top_k=5)
    assert head_for(StepPlan([work(greedy), work(greedy)])) == "greedy"
    assert head_for(StepPlan([work(greedy), work(top_p, samples=False)])) == "greedy"  # still prefilling
    assert head_for(StepPlan([work(greedy), work(temp)])) == "unsorted"
    assert head_for(StepPlan([work(temp), work(top_p)])) == "filtered"
    assert head_for(StepPlan([work(top_k)])) == "unsorted"  # top-k <= SMALL_TOP_K: drawn from topk, no sort
    small_top_k_top_p = SamplingParams(temperature=0.8, top_k=64, top_p=0.5)
    assert head_for(StepPlan([work(temp), work(small_top_k_top_p)])) == "unsorted"
    assert head_for(StepPlan([work(SamplingParams(temperature=0.8, top_k=65))])) == "filtered"
    assert head_for(StepPlan([work(top_k), work(top_p)])) == "filtered"
    assert head_for(StepPlan([work(SamplingParams(top_k=5, top_p=0.5))])) == "greedy"  # temperature 0
