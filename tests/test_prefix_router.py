"""PrefixRouter (serve/prefix_router.py) through Ray Serve's own routing code, with fake replicas and no
Ray cluster: requests go through RequestRouter._choose_replica_for_request (Ray's routing tasks, backoff
and queue-length probes, which call our choose_replicas), one test through AsyncioRouter.assign_request
(which also calls on_request_routed / on_request_completed), and one through the by-value cloudpickle
copy of the class that Ray ships to the ingress process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from unittest.mock import Mock

import pytest
from ray.serve._private import router as ray_router
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    ReplicaQueueLengthInfo,
    RequestMetadata,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RunningReplica

from thunder_batch.serve.prefix_router import PrefixRouter, RouteKey, block_hashes, prompt_text

DEPLOYMENT = DeploymentID(name="engine", app_name="thunder")


@pytest.fixture(autouse=True)
def no_ray_cluster(monkeypatch):
    """A stray ray.get_runtime_context() would start a local Ray cluster (minutes here): fail instead."""
    monkeypatch.setattr("ray._private.auto_init_hook.enable_auto_connect", False)


class FakeResult:
    """The ReplicaResult surface AsyncioRouter uses: the accept/reject answer and done-callbacks."""

    def __init__(self, accepted: bool, ongoing: int):
        self.info = ReplicaQueueLengthInfo(accepted=accepted, num_ongoing_requests=ongoing)
        self.callbacks = []

    async def get_rejection_response(self):
        return self.info

    def add_done_callback(self, callback):
        self.callbacks.append(callback)

    def finish(self):
        """The call ended (Ray runs the callbacks from a worker thread; they hop onto the router's loop)."""
        for callback in self.callbacks:
            callback(None)

    def cancel(self):
        self.finish()


class FakeReplica(RunningReplica):
    """What Ray's routing code reads of a running replica, without an actor."""

    def __init__(self, unique_id: str, max_ongoing_requests: int = 64, rejects: int = 0):
        self._id = ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)
        self._max, self.rejects, self.results = max_ongoing_requests, rejects, []

    replica_id = property(lambda self: self._id)
    max_ongoing_requests = property(lambda self: self._max)
    node_id = property(lambda self: "node")
    availability_zone = property(lambda self: None)
    multiplexed_model_ids = property(lambda self: set())
    is_cross_language = property(lambda self: False)
    actor_id = property(lambda self: None)

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    def push_proxy_handle(self, handle) -> None:
        pass

    def try_send_request(self, pr: PendingRequest, with_rejection: bool) -> FakeResult:
        accepted = self.rejects == 0
        self.rejects = max(0, self.rejects - 1)
        self.results.append(FakeResult(accepted, len(self.results) if accepted else self._max))
        return self.results[-1]


def make_router(n: int = 3, **state) -> tuple[PrefixRouter, list[FakeReplica]]:
    """Call inside a running loop (update_replicas starts probe tasks on it)."""
    router = PrefixRouter(
        deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
    )
    router.initialize_state(**state)
    replicas = [FakeReplica(f"r{i}") for i in range(n)]
    router.update_replicas(list(reversed(replicas)))  # candidate order must not matter
    return router, replicas


def pending(route: RouteKey | None, request_id: str | None = None) -> PendingRequest:
    meta = RequestMetadata(request_id="req", internal_request_id=request_id or uuid.uuid4().hex, is_streaming=True)
    return PendingRequest(args=[{"prompts": []}], kwargs={} if route is None else {"route": route}, metadata=meta)


async def send(router: PrefixRouter, route: RouteKey | None, request_id: str | None = None) -> str:
    """Route one call through Ray's routing loop, then report it accepted as AsyncioRouter does."""
    pr = pending(route, request_id)
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), 5)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id.unique_id


def rid(unique_id: str) -> ReplicaID:
    return ReplicaID(unique_id=unique_id, deployment_id=DEPLOYMENT)


def run(scenario):
    """A test that runs the async scenario on a fresh event loop."""

    def test():
        asyncio.run(scenario())

    test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
    return test


def chat(*turns: str) -> list[dict]:
    roles = ("user", "assistant")
    return [{"role": "system", "content": "You answer briefly."}] + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)
    ]


@run
async def test_a_conversations_later_turns_go_to_turn_ones_replica():
    router, _ = make_router(3, imbalance=4, block_chars=16)
    fillers = ("Tell me about tides, at length please.", "Ferns: how do they spread?")
    for i, text in enumerate(fillers):  # other requests: r0, then r1 (among the idle, fewest blocks, then id)
        assert await send(router, RouteKey(text), request_id=f"filler{i}") == f"r{i}"
    turns = ["Explain the printing press in Europe.", "It spread fast.", "Why so fast?", "Cheap paper.", "Thanks"]
    turn1 = prompt_text(chat(turns[0]))
    assert await send(router, RouteKey(turn1)) == "r2"
    router.on_request_completed(rid("r0"), "filler0")
    router.on_request_completed(rid("r1"), "filler1")
    for k in (3, 5):  # turns 2 and 3: longer texts that extend turn 1's; the earlier turns stay in flight
        messages = chat(*turns[:k])
        messages[-1]["content"] = [{"type": "text", "text": turns[k - 1]}]  # OpenAI's part-list form
        assert prompt_text(messages).startswith(turn1)
        assert await send(router, RouteKey(prompt_text(messages))) == "r2"  # r0 and r1 are idle: still r2
    assert router.load(rid("r2")) == 3 and router.load(rid("r0")) == router.load(rid("r1")) == 0


@run
async def test_an_overloaded_holder_loses_the_request_to_the_least_loaded():
    router, _ = make_router(3, imbalance=2, block_chars=8)
    key = RouteKey("a shared system prompt that every request repeats")
    assert [await send(router, key) for _ in range(3)] == ["r0"] * 3  # loads 0, 1, 2 <= 0 + 2
    assert await send(router, key) == "r1"  # r0 at 3 > 0 + 2: the least loaded (fewest blocks, then id)
    assert await send(router, key) == "r1"  # r1 read the prefix last, so holds it, and is within bounds


@run
async def test_a_session_pin_beats_the_prefix_and_yields_to_overload():
    router, _ = make_router(2, imbalance=1, block_chars=8)
    text = "the conversation held by r0, long enough for blocks"
    assert await send(router, RouteKey(text)) == "r0"
    assert await send(router, RouteKey("another text, somewhere else", session="s")) == "r1"
    assert await send(router, RouteKey(text, session="s")) == "r1"  # the pin wins over r0's prefix
    assert await send(router, RouteKey("a third text", session="s")) == "r1"  # loads 1, 2: 2 <= 1 + 1
    assert await send(router, RouteKey("a fourth text", session="s")) == "r0"  # r1 at 3 > 1 + 1
    assert await send(router, RouteKey("a fifth", session="s")) == "r0"  # the session is pinned to r0 now


@run
async def test_a_pin_to_a_replica_that_is_gone_falls_back():
    router, replicas = make_router(3, block_chars=8)
    text = "a prompt first read by r0 and later by nobody"
    assert await send(router, RouteKey(text)) == "r0"
    assert await send(router, RouteKey("the user's own text", session="u")) == "r1"
    router.update_replicas([replicas[0], replicas[2]])  # r1 scaled away
    assert await send(router, RouteKey(text, session="u")) == "r0"  # the prefix holder
    router.on_replica_actor_died(replicas[0].replica_id)  # r0 died: r2 is the only candidate left
    assert router.load(rid("r0")) == 0
    assert await send(router, RouteKey(text, session="u")) == "r2"
    assert await send(router, RouteKey("x", session="u")) == "r2"  # and the pin moved with it


@run
async def test_fan_out_covers_every_replica_once_and_counts_no_load():
    router, _ = make_router(4)
    chosen = [await send(router, RouteKey(replica=k), request_id="stats-call") for k in range(4)]
    assert chosen == ["r0", "r1", "r2", "r3"]  # by unique_id, whatever order Ray lists them in
    assert await send(router, RouteKey(replica=5), request_id="stats-call") == "r1"
    assert all(router.load(rid(f"r{i}")) == 0 for i in range(4)) and not router._blocks
    for i in range(4):  # their completions do not disturb the counts
        router.on_request_completed(rid(f"r{i}"), "stats-call")
    assert await send(router, RouteKey("some prompt text")) == "r0"


@run
async def test_a_burst_chosen_before_any_is_accepted_spreads_over_the_replicas():
    """Ray's routing tasks choose for every request of a burst before the first is accepted: the choices
    count as load at once, or all of them would go to the same (then idle) replica."""
    router, _ = make_router(2)
    burst = [pending(RouteKey(f"short prompt {i}")) for i in range(4)]
    chosen = await asyncio.gather(*(asyncio.wait_for(router._choose_replica_for_request(p), 5) for p in burst))
    assert sorted(r.replica_id.unique_id for r in chosen) == ["r0", "r0", "r1", "r1"]
    for p, replica in zip(burst, chosen):
        router.on_request_routed(p, replica.replica_id, None)
    assert router.load(rid("r0")) == router.load(rid("r1")) == 2 and not router._reserved
    for p, replica in zip(burst, chosen):
        router.on_request_completed(replica.replica_id, p.metadata.internal_request_id)
    assert router.load(rid("r0")) == router.load(rid("r1")) == 0


@run
async def test_a_choice_turned_away_or_cancelled_stops_counting():
    router, _ = make_router(2)
    turned_away, cancelled = pending(RouteKey("a")), pending(RouteKey("b"))
    first = await asyncio.wait_for(router._choose_replica_for_request(turned_away), 5)
    router.on_request_completed(first.replica_id, turned_away.metadata.internal_request_id)  # a refusal
    second = await asyncio.wait_for(router._choose_replica_for_request(cancelled), 5)
    cancelled.future = asyncio.get_running_loop().create_future()
    cancelled.future.cancel()
    await send(router, RouteKey("c"))  # the next choice drops the cancelled one
    assert sum(router.load(rid(f"r{i}")) for i in range(2)) == 1, (first, second, router._reserved)


@run
async def test_completions_bring_the_load_back_to_zero():
    router, _ = make_router(2)
    ids = [await send(router, RouteKey("p"), request_id=f"q{i}") for i in range(3)]
    assert ids == ["r0", "r1", "r0"] and router.load(rid("r0")) == 2
    router.on_request_completed(rid("r1"), "q0")  # not where q0 went (a turned-away attempt): no effect
    assert router.load(rid("r0")) == 2
    for i, where in enumerate(ids):
        router.on_request_completed(rid(where), f"q{i}")
    router.on_request_completed(rid("r1"), "q1")  # a second completion counts for nothing
    assert router.load(rid("r0")) == router.load(rid("r1")) == 0
    router.on_request_completed(rid("r0"), "fast")  # a call that ended before its on_request_routed ran
    assert await send(router, RouteKey("p"), request_id="fast") == "r0"
    assert router.load(rid("r0")) == router.load(rid("r1")) == 0
    # Two calls under one internal_request_id (calls a replica makes while serving one request) both count.
    assert [await send(router, RouteKey("p"), request_id="shared") for _ in range(2)] == ["r0", "r1"]
    router.on_request_completed(rid("r0"), "shared")
    assert router.load(rid("r0")) == 0 and router.load(rid("r1")) == 1


@run
async def test_lru_bounds_keep_the_index_and_the_pins_small():
    router, _ = make_router(2, block_chars=4, max_blocks=6, max_sessions=2)
    for i in range(5):
        await send(router, RouteKey(f"text number {i} with blocks", session=f"s{i}"), request_id=f"t{i}")
    assert len(router._blocks) == 6 and sum(router._block_counts.values()) == 6
    assert list(router._sessions) == ["s3", "s4"]
    assert (await send(router, RouteKey("x", session="s0"))) == "r1"  # s0's pin (to r0) was evicted
    long_text = "abcdefghijklmnopqrstuvwxyz0123456789"  # 9 blocks: more than the index holds
    assert await send(router, RouteKey(long_text)) == "r1"
    assert list(router._blocks) == block_hashes(long_text, 4)[5::-1]  # its head kept, its tail evicted
    assert router._block_counts == {rid("r1"): 6}
    for i in range(5):
        router.on_request_completed(rid("r0"), f"t{i}")
    assert router.load(rid("r0")) == 0 and router.load(rid("r1")) == 2
    assert await send(router, RouteKey(long_text[:20] + "!")) == "r1"  # 5 blocks matched: not the idle r0


@run
async def test_least_loaded_policy_ignores_prefixes_and_sessions():
    router, _ = make_router(2, policy="least_loaded", block_chars=4)
    text = "a long prompt that r0 would hold under the prefix policy"
    assert await send(router, RouteKey(text, session="s")) == "r0"
    assert await send(router, RouteKey(text, session="s")) == "r1"
    assert await send(router, RouteKey(text + " more", session="s")) == "r0"
    assert not router._blocks and not router._sessions


@run
async def test_a_call_without_a_route_key_is_least_loaded():
    router, _ = make_router(2)
    assert [await send(router, None), await send(router, None)] == ["r0", "r1"]
    assert router.load(rid("r0")) == router.load(rid("r1")) == 1


def test_prompt_text_canonical_forms():
    assert prompt_text("Once upon a time") == "Once upon a time"
    assert prompt_text([[1, 2, 30]]) == "1,2,30" == prompt_text([1, 2, 30])
    assert prompt_text(["first prompt", "second prompt"]) == "first prompt"
    assert prompt_text([[5, 6], [7]]) == "5,6"
    parts = [{"type": "text", "text": "Hi "}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "there"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    assert prompt_text(messages) == "system\nBe brief.\nuser\nHi there\n"
    assert prompt_text([messages, [{"role": "user", "content": "other"}]]) == "system\nBe brief.\nuser\nHi there\n"
    assert prompt_text([{"role": "assistant", "content": None}]) == "assistant\n\n"
    assert prompt_text([]) == prompt_text(None) == ""
    turn2 = messages + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]
    assert prompt_text(turn2).startswith(prompt_text(messages))
    assert block_hashes("ab\ud800cd", 2)[:1] == block_hashes("ab", 2)  # a lone surrogate (valid JSON) hashes


def test_settings_are_checked_and_fit_the_deployment_option():
    router = PrefixRouter(  # every keyword Ray 2.60's AsyncioRouter.request_router passes
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        self_node_id="node",
        self_actor_id="actor",
        self_actor_handle=None,
        use_replica_queue_len_cache=True,
        create_replica_wrapper_func=lambda info: None,
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
        initial_backoff_s=0.025,
        backoff_multiplier=2,
        max_backoff_s=0.5,
    )
    assert (router.policy, router.imbalance, router.block_chars) == ("prefix", 4, 128)
    with pytest.raises(ValueError, match="'pow2'.*prefix, least_loaded"):
        router.initialize_state(policy="pow2")
    with pytest.raises(ValueError, match="block_chars"):
        router.initialize_state(block_chars=0)
    kwargs = {"policy": "least_loaded", "imbalance": 2, "block_chars": 64, "max_blocks": 10, "max_sessions": 5}
    config = RequestRouterConfig(request_router_class=PrefixRouter, request_router_kwargs=kwargs)
    assert config.request_router_class == "thunder_batch.serve.prefix_router.PrefixRouter"
    router.initialize_state(**config.request_router_kwargs)
    assert (router.policy, router.imbalance, router.block_chars) == ("least_loaded", 2, 64)


def test_through_ray_asyncio_router_hooks(monkeypatch):
    """Ray's AsyncioRouter (what a handle's .remote() runs): it passes `route=` to choose_replicas, calls
    on_request_routed when a replica accepts and on_request_completed when the call ends; a replica that
    turns a call away is skipped on the retry (Ray's queue-length cache marks it full)."""
    monkeypatch.setattr(ray_router.SharedRouterLongPollClient, "get_or_create", Mock())

    async def scenario():
        router, replicas = make_router(2, imbalance=4, block_chars=8)
        handle_router = ray_router.AsyncioRouter(
            controller_handle=Mock(),
            deployment_id=DEPLOYMENT,
            handle_id="ingress",
            self_actor_id="ingress-actor",
            handle_source=DeploymentHandleSource.UNKNOWN,
            event_loop=asyncio.get_running_loop(),
            enable_strict_max_ongoing_requests=True,  # what every Python handle outside Ray Client uses
            node_id="node",
            availability_zone=None,
            prefer_local_node_routing=False,
            request_router=router,
            _request_router_initialized_event=asyncio.Event(),  # else it blocks this loop making one
        )
        try:
            await turns_and_a_rejection(handle_router, router, replicas)
        finally:
            handle_router.long_poll_client.stop()
            await handle_router.shutdown()

    asyncio.run(scenario())


async def turns_and_a_rejection(handle_router, router: PrefixRouter, replicas: list[FakeReplica]) -> None:
    async def call(text: str, request_id: str):
        meta = RequestMetadata(request_id=request_id, internal_request_id=request_id, is_streaming=True)
        return await asyncio.wait_for(handle_router.assign_request(meta, {"prompts": [text]}, route=RouteKey(text)), 5)

    turn1 = "system\nBe brief.\nuser\nWhat is a prefix cache?\n"
    await call(turn1, "t1")
    await call(turn1 + "assistant\nA cache of prompt prefixes.\nuser\nWhy?\n", "t2")
    assert [len(r.results) for r in replicas] == [2, 0] and router.load(replicas[0].replica_id) == 2
    replicas[1].rejects = 1  # full: turns the next call away once, then the retry goes to r0
    await call("an unrelated prompt, new to both replicas", "t3")
    assert [len(r.results) for r in replicas] == [3, 1] and not replicas[1].results[0].info.accepted
    assert router.load(replicas[0].replica_id) == 3 and router.load(replicas[1].replica_id) == 0
    for result in replicas[0].results:
        result.finish()
    await asyncio.sleep(0.01)  # the completions hop onto the loop (call_soon_threadsafe)
    assert router.load(replicas[0].replica_id) == router.load(replicas[1].replica_id) == 0


CHILD = """
import asyncio, sys
from ray import cloudpickle
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest
cls = cloudpickle.loads(sys.stdin.buffer.read())
from thunder_batch.serve.prefix_router import PrefixRouter, RouteKey  # what the ingress imports
copied = cls.choose_replicas.__globals__["route_of"].__globals__["NO_ROUTE"]
assert cls is not PrefixRouter and type(copied) is not RouteKey  # isinstance(key, RouteKey) would fail there
d = DeploymentID(name="engine", app_name="thunder")
router = cls(deployment_id=d, handle_source=DeploymentHandleSource.UNKNOWN)
router.initialize_state(imbalance=1)
class Replica:
    def __init__(self, i): self.replica_id = ReplicaID(unique_id=f"r{i}", deployment_id=d)
async def choose():
    meta = RequestMetadata(request_id="x", internal_request_id="x")
    pr = PendingRequest(args=[], kwargs={"route": RouteKey(replica=2)}, metadata=meta)
    return await router.choose_replicas([Replica(i) for i in range(3)], pr)
print(asyncio.run(choose())[0][0].replica_id.unique_id)
"""


def test_the_copy_ray_ships_to_the_ingress_reads_the_ingress_route_keys():
    """Ray cloudpickles the router's module by value: in another process its RouteKey is another class."""
    config = RequestRouterConfig(request_router_class=PrefixRouter)
    child = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=config.get_serialized_request_router_cls(),
        capture_output=True,
        env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"},  # never start a Ray cluster
        timeout=120,
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().split() == ["r2"]
