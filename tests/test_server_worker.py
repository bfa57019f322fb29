"""The inference worker of `thunder-batch serve` on a tiny model (token ids, no tokenizer), without
processes: admission and usage, choices (n, several prompts) against the engine run offline, logprobs,
the cancel board (also before admission), failed steps and health, the loop's idling and routing."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque

import pytest

from thunder_batch.config import SamplingParams, choice_seed
from thunder_batch.serve.cancels import CancelBoard
from thunder_batch.serve.server import health_problems
from thunder_batch.serve.shared_state import MESSAGES_UID, SharedState, process_alive

from helpers import tiny_gpt

OPTIONS = dict(batch_size=2, max_seq_length=32, prefill_chunk=4, compile="eager")


def tiny_api(state=None, board=None):
    from thunder_batch import Engine
    from thunder_batch.cli.options import EngineOptions
    from thunder_batch.serve.routes import OpenAIRoutes, ServeSettings
    from thunder_batch.serve.worker import EngineAPI

    options = EngineOptions(**OPTIONS)
    state, board = state or SharedState(1, 1), board or CancelBoard(64)
    api = EngineAPI(options, OpenAIRoutes(ServeSettings("tiny"), state, board), state, board, "tiny")
    api.attach(Engine(tiny_gpt("llama"), options.engine_config()))
    return api


def greedy(max_tokens: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, temperature=0.0, **kw)


def payload(*prompts, params, n=1, echo=False, logprobs=False) -> dict:
    return dict(prompts=list(prompts), params=params, n=n, echo=echo, logprobs=logprobs, arrival=time.time())


def add(api, items):
    return api.admit(api.prepare(items))


def run_all(api) -> dict:
    """Step until every request finished: uid -> its messages in order."""
    messages = {}
    while api.has_active_requests():
        for uid, m, _ in api.step():
            messages.setdefault(uid, []).append(m)
    return messages


def test_admits_rejects_and_reports_usage():
    api = tiny_api()
    admitted = add(
        api,
        [
            ("a", payload([1, 2, 3, 4, 5], params=greedy(6))),
            ("b", payload([7] * 30, params=greedy(6))),  # 30 + 6 > 32
            ("c", payload([7] * 40, params=greedy(None))),  # the prompt alone does not fit
            ("d", payload([3, 10**6], params=greedy(2))),  # the engine's own check
            ("e", payload([9, 8], params=greedy(None))),  # None: the rest of the cache, 30 tokens
            ("f", payload([9, 8], params=greedy(2, stop=["x"]))),  # string stops need a tokenizer
        ],
    )
    assert [(uid, m["event"], done) for uid, m, done in admitted] == [
        ("a", "accepted", False),
        ("b", "error", True),
        ("c", "error", True),
        ("d", "error", True),
        ("e", "accepted", False),
        ("f", "error", True),
    ]
    assert admitted[0][1]["prompt_tokens"] == 5
    errors = {uid: m["error"] for uid, m, _ in admitted if m["event"] == "error"}
    assert {uid: (e["status"], e["code"], e["param"]) for uid, e in errors.items()} == {
        "b": (400, "context_length_exceeded", "max_tokens"),
        "c": (400, "context_length_exceeded", "prompt"),
        "d": (400, "invalid_value", "prompt"),
        "f": (400, "invalid_value", "stop"),
    }
    assert "32" in errors["b"]["message"] and "token ids must be in" in errors["d"]["message"]
    finals = {uid: ms[-1] for uid, ms in run_all(api).items()}
    assert finals == {
        uid: {"event": "delta", "index": 0, "text": "", "finish_reason": "length", "completion_tokens": n}
        for uid, n in [("a", 6), ("e", 30)]
    }
    assert api.state.published(0)["free_slots"] == 2 and api.state.worker(0).running == 0


def test_choices_are_the_requests_alone_with_their_own_seeds():
    """n=2 over two prompts: choice i*n + j answers prompt i; choice 0 of each prompt is the request
    alone (the same seed), choice 1 draws from choice_seed(seed, 1); usage counts each prompt once."""
    from thunder_batch import Engine, EngineConfig

    api = tiny_api()
    sampled = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    [(_, accepted, _)] = add(api, [("u", payload(*prompts, params=sampled, n=2, logprobs=True))])
    assert accepted["prompt_tokens"] == 8
    messages = run_all(api)["u"]
    finals = {m["index"]: m["completion_tokens"] for m in messages if "finish_reason" in m}
    assert finals == {0: 8, 1: 8, 2: 8, 3: 8}
    got = {i: [int(e[0][1:-1]) for m in messages if m["index"] == i for e in m["logprobs"]] for i in range(4)}
    offline = Engine(tiny_gpt("llama"), EngineConfig(**OPTIONS))
    for i, prompt in enumerate(prompts):
        assert got[2 * i] == offline.generate([prompt], sampled)[0].token_ids  # choice 0: the request alone
        pair = offline.prepare(prompt, sampled, ["x", "y"])
        assert pair[1].seed == choice_seed(5, 1)
        offline.enqueue(pair)
        while offline.has_unfinished():
            offline.step()
        assert got[2 * i + 1] == pair[1].output_ids != got[2 * i]


def test_logprob_messages_carry_each_token_and_its_alternatives():
    api = tiny_api()
    params = greedy(4, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    add(api, [("u", payload([5, 6, 7], params=params, echo=True, logprobs=True))])
    messages = run_all(api)["u"]
    entries = [e for m in messages for e in m["logprobs"]]
    assert len(entries) == 4 and all(len(e[2]) == 2 for e in entries)
    assert all(e[2][0][1] >= e[2][1][1] and e[1] <= e[2][0][1] + 1e-6 for e in entries)
    echo = messages[0]["echo"]
    assert echo["text"] == "<5><6><7>" and [e[0] for e in echo["logprobs"]] == ["<5>", "<6>", "<7>"]
    assert echo["logprobs"][0][1] is None and all(isinstance(e[1], float) for e in echo["logprobs"][1:])


def test_a_completion_ended_by_a_stop_token_lists_it_in_its_logprobs_as_openai_does():
    """The EOS (a stop token id) leaves the text and the token count, but a scorer reads its logprob
    (lm-eval's loglikelihood takes every entry but the last, made by max_tokens 1)."""
    api = tiny_api()
    add(api, [("a", payload([5, 6, 7], params=greedy(1, logprobs=1), logprobs=True))])
    [[first]] = [m["logprobs"] for m in run_all(api)["a"]]
    stop_id = int(first[0].strip("<>"))
    api.engine.reset_prefix_cache()  # the first request's plan again (reused entries: logprobs to rounding only)
    add(api, [("b", payload([5, 6, 7], params=greedy(1, logprobs=1, stop_token_ids=[stop_id]), logprobs=True))])
    [message] = run_all(api)["b"]
    assert (message["finish_reason"], message["completion_tokens"], message["text"]) == ("stop", 0, "")
    assert message["logprobs"] == [first]


def test_cancels_before_admission_and_while_running():
    board = CancelBoard(64)
    api = tiny_api(board=board)
    add(api, [(uid, payload([1, 2, 3], params=greedy(20))) for uid in ("a" * 32, "b" * 32)])
    api.step()
    board.post("a" * 32)  # its client left while it ran
    board.post("c" * 32)  # and this one's before any worker took it
    assert ("a" * 32, {"event": "aborted"}, True) in api.step()
    assert api.engine.scheduler.find("a" * 32 + "/0") is None and api.engine.stats()["running"] == 1
    assert board.pending() == 1  # c's cancel waits for c
    [(uid, message, done)] = add(api, [("c" * 32, payload([4, 5], params=greedy(5)))])
    assert (uid, message, done) == ("c" * 32, {"event": "aborted"}, True) and board.pending() == 0
    assert api.engine.scheduler.find("c" * 32 + "/0") is None


def test_failed_steps_make_the_worker_unhealthy_until_a_step_succeeds():
    state = SharedState(1, 1)
    api = tiny_api(state=state)
    assert health_problems(state) == []
    run = api.engine.runner.run
    api.engine.runner.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    for i in range(3):
        add(api, [(str(i), payload([1, 2, 3], params=greedy(20)))])
        with pytest.raises(RuntimeError):
            api.step()
        assert [(uid, m["error"]["status"], done) for uid, m, done in api.fail_all()] == [(str(i), 500, True)]
        assert not api.engine.has_unfinished() and not api.has_active_requests()
        api.step_failed(True)
        assert bool(health_problems(state)) == (i == 2)
    assert health_problems(state) == ["worker 0: its last 3 steps failed"] and api.room() == 0
    with pytest.raises(RuntimeError):
        api.probe()
    api.engine.runner.run = run
    api.probe()  # what the loop does while the worker is unhealthy and idle
    api.step_failed(False)
    assert health_problems(state) == [] and api.room() == 4


def test_health_sees_dead_and_missing_workers_and_draining():
    state = SharedState(2, 1)
    state.set_worker(0, pid=os.getpid(), ready=1)
    assert health_problems(state) == ["worker 1 is starting (or restarting after it stopped)"]
    state.set_worker(1, pid=2**22 + 12345, ready=1)  # no such process
    assert not process_alive(2**22 + 12345) and len(health_problems(state)) == 1
    state.set_worker(1, pid=os.getpid())
    state.start_draining()
    assert health_problems(state) == ["draining: the server is shutting down"]


def test_cancel_board_entries_expire_and_a_full_board_drops_the_oldest(monkeypatch):
    from thunder_batch.serve import cancels

    board = CancelBoard(4)
    uids = [f"{i:032x}" for i in range(6)]
    for uid in uids[:4]:
        board.post(uid)
    assert board.pending() == 4 and board.claim([uids[1]]) == [uids[1]] and board.pending() == 3
    board.post(uids[4])  # reuses the claimed entry
    assert set(board.posted()) == {uids[0], uids[2], uids[3], uids[4]}
    monkeypatch.setattr(cancels, "TTL_S", -1.0)  # every entry is old now
    board.post(uids[5])
    assert len(board.posted()) == 4 and uids[5] in board.posted()


def test_shared_state_counts_and_publishes():
    state = SharedState(2, 3)
    state.add_in_flight(0, 5)
    state.add_in_flight(2, 2)
    state.add_in_flight(0, -1)
    assert state.in_flight() == 6
    assert state.published(1) == {}
    state.publish(1, {"steps": 3, "programs": {"head": 1}})
    assert state.published(1) == {"steps": 3, "programs": {"head": 1}}


def test_engine_loop_idles_on_an_event_and_routes_events():
    from litserve.utils import LitAPIStatus

    from thunder_batch.serve.loop import IDLE_WAIT_S, EngineLoop

    api, loop, steps = tiny_api(), EngineLoop(), []
    api.step = lambda: steps.append(1) or []

    async def timed_runs():
        start = time.perf_counter()
        await loop.run(api, "cpu", 0, None, None, {}, None)  # nothing to do: waits, never steps
        idle = time.perf_counter() - start
        asyncio.get_running_loop().call_later(0.05, loop._events()[0].set)  # what an admission does
        start = time.perf_counter()
        await loop.run(api, "cpu", 0, None, None, {}, None)
        return idle, time.perf_counter() - start

    idle, woken = asyncio.run(timed_runs())
    assert idle >= 0.9 * IDLE_WAIT_S and woken < 0.5 * IDLE_WAIT_S and steps == []

    sent = []

    class Transport:
        def send(self, item, consumer_id):
            sent.append((consumer_id, item[0], item[1][0]))

    loop.response_queue_ids = {"a": 3, "b": 3, "c": 1}
    loop._send(Transport(), [("a", {}, False), ("a", {}, True), ("unknown", {}, True), ("c", {"x": 1}, False)])
    a = [("a", {}, LitAPIStatus.OK), ("a", {}, LitAPIStatus.FINISH_STREAMING)]
    assert sent == [(3, MESSAGES_UID, a), (1, MESSAGES_UID, [("c", {"x": 1}, LitAPIStatus.OK)])]  # one per process
    assert loop.response_queue_ids == {"b": 3, "c": 1}

    from litserve.utils import ResponseBufferItem

    from thunder_batch.serve.in_flight import Messages

    buffer = {"a": ResponseBufferItem(asyncio.Event(), deque())}
    Messages(buffer).append((a + [("gone", {}, LitAPIStatus.OK)], LitAPIStatus.OK))
    assert list(buffer["a"].response_queue) == [({}, LitAPIStatus.OK), ({}, LitAPIStatus.FINISH_STREAMING)]


def test_the_engine_is_loaded_warmed_up_and_stepped_on_one_thread(monkeypatch):
    """Each thread that starts torch's OpenMP regions gets a team of its own; with more OpenMP threads than
    cores libgomp stops spinning between regions, and a decode step ran 25-45% slower in the server."""
    import signal
    import threading

    from thunder_batch import Engine
    from thunder_batch.cli.options import EngineOptions
    from thunder_batch.serve.loop import EngineLoop

    threads = {}

    def load_engine(options, device="cpu"):
        threads["load"] = threading.get_ident()
        return Engine(tiny_gpt("llama"), options.engine_config())

    monkeypatch.setattr(EngineOptions, "load_engine", load_engine)
    api, handler = tiny_api(), signal.getsignal(signal.SIGTERM)
    api.engine_thread = None
    try:
        api.setup("cpu")
    finally:
        signal.signal(signal.SIGTERM, handler)  # setup installs the worker's own
    api.has_active_requests = lambda: True
    api.step = lambda: threads.setdefault("step", threading.get_ident()) and []
    asyncio.run(EngineLoop().run(api, "cpu", 0, None, None, {}, None))
    assert threads["load"] == threads["step"] != threading.get_ident()


def test_cpu_workers_split_torch_threads_unless_omp_num_threads_is_set(monkeypatch):
    import torch

    from thunder_batch.serve.worker import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        seen = []
        for device, workers, env in [
            ("cpu", 2, None),
            ("cpu", 8, None),
            ("cpu", 1, None),
            ("cuda:0", 2, None),
            ("cpu", 2, "4"),
        ]:
            torch.set_num_threads(4)
            if env:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            share_cpu_threads(device, workers)
            seen.append(torch.get_num_threads())
        assert seen == [2, 1, 4, 4, 4]
    finally:
        torch.set_num_threads(before)


# -- races found by reading (issue: the server under real traffic) ----------------------------------
def test_accepted_is_sent_before_the_first_token_even_when_a_step_overtakes_the_admission():
    """admit releases the engine lock before its "accepted" is sent; a step run in that gap has the
    request's first token. The loop's order lock holds the step's messages until the admission's are out."""
    import threading

    from thunder_batch.serve.loop import EngineLoop

    api, loop, sent = tiny_api(), EngineLoop(), []
    admit, step = api.admit, api.step
    admitted, stepped = threading.Event(), threading.Event()

    def slow_to_return(prepared):  # the engine lock is released; the thread is not scheduled back yet
        events = admit(prepared)
        admitted.set()
        stepped.wait(1.0)  # a step that may run now does (without the order lock it would)
        return events

    def step_once_admitted():
        events = step() if admitted.is_set() else []
        if events:
            stepped.set()
        return events

    api.admit, api.step = slow_to_return, step_once_admitted

    class Queue:  # LitServe's request queue with one request on it
        items = [(0, "u" * 32, time.monotonic(), payload([1, 2, 3], params=greedy(1)))]  # one token: one delta

        def get(self, block=True, timeout=None):
            import queue

            if not self.items:
                raise queue.Empty
            return self.items.pop()

    class Transport:
        def send(self, item, consumer_id):
            sent.extend(message.get("event") for _, message, _ in item[1][0])  # a batch of (uid, message, status)

    async def both():
        intake = asyncio.ensure_future(loop._intake(api, Queue(), Transport()))
        while not admitted.is_set():
            assert not intake.done(), intake.exception()
            await asyncio.sleep(0.01)
        await loop.run(api, "cpu", 0, None, Transport(), {}, None)  # the step runs inside the gap
        await intake

    asyncio.run(both())
    assert sent[:3] == ["claimed", "accepted", "delta"], sent


def test_a_cancel_posted_while_a_worker_reads_the_board_is_not_lost():
    """A post that reuses an entry between a reader's copies of the states and the uids: the reader must
    not pair the entry's old uid with the new post (claiming the old uid would drop the new cancel)."""
    board = CancelBoard(1)
    old, new = "a" * 32, "b" * 32
    board.post(old)
    assert board.claim([old]) == [old]  # entry 0 is free again; its bytes still hold `old`

    class PostWhileCopied:  # the uids copied, then another process posts `new` into entry 0
        def __init__(self, raw):
            self.raw, self.fired = raw, False

        def __bytes__(self):
            copy = bytes(self.raw)
            if not self.fired:
                self.fired = True
                board._uids = self.raw
                board.post(new)
            return copy

    board._uids = PostWhileCopied(board._uids)
    board._seen = (-1, {})  # a worker that has not read the board since
    assert board.claim({old}) == []  # the finished `old` (a worker clears late cancels of its finished uids)
    assert board.claim([new]) == [new]


def test_an_http_process_that_died_leaves_no_count_behind():
    import multiprocessing as mp

    state = SharedState(1, 2)
    state.add_in_flight(0, 1)
    child = mp.get_context("fork").Process(target=state.add_in_flight, args=(1, 3))
    child.start()
    child.join()
    assert state.in_flight() == 1  # the child counted 3 and died without finishing them
    state.add_in_flight(1, 2)  # a new process in that row starts from zero
    assert state.in_flight() == 3


def test_an_idle_worker_reads_a_burst_of_requests_together_and_a_busy_one_does_not_wait():
    """Requests sent at once reach the worker a few ms apart: an idle engine takes them into one first
    step (one wide prompt step, not several narrow ones while the rest queue); a lone request waits at
    most GATHER_S more; an engine already stepping takes only what is queued."""
    import queue
    import threading

    from thunder_batch.serve.loop import GATHER_S, TAKE_WAIT_S, EngineLoop
    from thunder_batch.serve.shared_state import SharedState

    def arriving(n: int, every_s: float) -> tuple[queue.Queue, SharedState]:
        q, state = queue.Queue(), SharedState(1, 1)

        def put():
            for i in range(n):
                q.put((0, f"r{i}", 0.0, {"prompts": [[1, 2]]}))
                state.announce_request()  # as an HTTP process does after its put
                time.sleep(every_s)

        threading.Thread(target=put, daemon=True).start()
        return q, state.wait_for_request

    loop, window = EngineLoop(), 0.2  # a wide window here: arrivals on a loaded machine drift by ms
    burst = loop._take_requests(*arriving(6, window / 10), room=8, gather_s=window)
    assert [uid for _, uid, _, _ in burst] == [f"r{i}" for i in range(6)]
    capped = loop._take_requests(*arriving(6, window / 10), room=4, gather_s=window)
    assert len(capped) == 4  # never more than the engine has room for
    busy = loop._take_requests(*arriving(6, window / 10), room=8, gather_s=0.0)
    assert [uid for _, uid, _, _ in busy] == ["r0"]
    start = time.perf_counter()
    alone = loop._take_requests(*arriving(1, 0.0), room=8, gather_s=window)
    assert len(alone) == 1 and window <= time.perf_counter() - start < TAKE_WAIT_S + 2 * window
    assert GATHER_S <= 0.02  # what a lone request to an idle server waits at most


def test_an_idle_worker_sleeps_until_a_request_is_announced_and_never_leaves_a_get_pending():
    """Idle, the worker makes one non-blocking get per TAKE_WAIT_S (each a round trip to LitServe's manager
    process), not one every few ms; an announced request is taken at once, well before the TAKE_WAIT_S a missed
    wake-up would cost."""
    import queue
    import threading

    from thunder_batch.serve.loop import TAKE_WAIT_S, EngineLoop
    from thunder_batch.serve.shared_state import SharedState

    class CountingQueue(queue.Queue):
        def get(self, block=True, timeout=None):
            assert not block, "a blocking get left pending would swallow a request if the worker died"
            self.gets = getattr(self, "gets", 0) + 1
            return super().get(block, timeout)

    q, state, loop = CountingQueue(), SharedState(1, 1), EngineLoop()
    start = time.perf_counter()
    assert loop._take_requests(q, state.wait_for_request, room=8, gather_s=0.01) == []
    assert time.perf_counter() - start >= 0.9 * TAKE_WAIT_S and q.gets <= 3  # polling every 5 ms made ~200

    def announce_later():
        time.sleep(0.3)
        announced.append(time.perf_counter())  # before the put: the intake may return before this thread runs on
        q.put((0, "r0", 0.0, {"prompts": [[1]]}))
        state.announce_request()

    announced, q.gets = [], 0
    threading.Thread(target=announce_later, daemon=True).start()
    [item] = loop._take_requests(q, state.wait_for_request, room=8, gather_s=0.0)
    assert item[1] == "r0" and time.perf_counter() - announced[0] < 0.5 * TAKE_WAIT_S and q.gets <= 4
