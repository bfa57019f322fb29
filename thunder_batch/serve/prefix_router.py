"""Prefix-aware Ray Serve request router for the engine deployment of `serve --replicas N`.

Each engine replica keeps its own prefix cache, so a request costs least on the replica that already
prefilled the longest prefix of its prompt. The ingress passes a `RouteKey` as the `route=` keyword of
every call on the engine handle; `PrefixRouter` reads it and picks, in order:

1. the replica its session (x-session-id, else OpenAI's `user`) is pinned to,
2. else the replica that last read the longest indexed prefix of its text,

each only while that replica has at most `imbalance` more requests in flight (routed by this router, not
yet completed) than the least loaded candidate; 3. else the least loaded candidate. A fan-out call
(`RouteKey(replica=k)`, e.g. /stats) goes to the k-th replica by id and counts for nothing.

The index is over text, not tokens: the router sees a request before any tokenizer runs and needs none.
Chat turns are rendered as "<role>\\n<content>\\n" in order, so a conversation's next turn extends the
text of the one before; its full `block_chars` blocks, hashed as a chain (each hash covers the whole text
up to its block's end), equal the earlier turn's, and the walk finds the replica that holds them.

The state is per router: every process holding a handle to the engine (each ingress replica) has its
own index, pins and load counts. Ray runs all the hooks below on the router's event loop (completion
callbacks are moved onto it with call_soon_threadsafe), so the state needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from hashlib import blake2b

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

POLICIES = ("prefix", "least_loaded")
EARLY_COMPLETIONS_KEPT = 4096  # completions seen before their on_request_routed (see on_request_completed)


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: passed by the ingress as the keyword argument `route=` of every
    call on the engine deployment's handle (handle.options(stream=True).generate.remote(payload, route=key))."""

    text: str = ""  # the prompt as canonical text (chat turns joined), "" for none
    session: str | None = None  # x-session-id header, else OpenAI's `user` field; None: no pin
    replica: int | None = None  # a fan-out call: go to the k-th running replica, no load counted


NO_ROUTE = RouteKey()


def prompt_text(prompts) -> str:
    """Canonical text of a request's prompts for routing: a str as it is; chat messages (list of dicts with
    "role" and "content", content a str or a list of {"type": "text", "text": ...} parts) as
    "<role>\\n<content>\\n" per message, in order (so turn k+1 of a conversation extends turn k's text);
    token ids (list of ints) as their decimal ids joined by ","; a list of several prompts: the first one's text."""
    if isinstance(prompts, str):
        return prompts
    if not isinstance(prompts, (list, tuple)) or not prompts:
        return ""
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return ",".join(str(t) for t in prompts)
    if isinstance(prompts[0], dict):
        return "".join(f"{m.get('role', '')}\n{_content_text(m.get('content'))}\n" for m in prompts)
    return prompt_text(prompts[0])


def _content_text(content) -> str:
    """A message's text: a str as it is, text parts joined (other parts carry no text), None as ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """The chain hashes of `text`'s full blocks: hash_i = blake2b(hash_{i-1} + block_i), so two texts share
    hash_i exactly when they share their first i+1 blocks (a final partial block is left out)."""
    hashes, h = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        block = text[start : start + block_chars].encode("utf-8", "surrogatepass")  # JSON allows lone surrogates
        h = blake2b(h + block, digest_size=8).digest()
        hashes.append(h)
    return hashes


def route_of(pending_request: PendingRequest | None) -> RouteKey:
    """The request's RouteKey; a call without one (or with something else under `route`) has no preference.

    Read by its fields, not isinstance: Ray ships the router class to the ingress cloudpickled with this
    whole module by value (RequestRouterConfig._serialize_request_router_cls), so there the router's
    RouteKey is a copy, not the class the ingress imports and builds its keys with."""
    route = pending_request.kwargs.get("route") if pending_request is not None else None
    if all(hasattr(route, field) for field in ("text", "session", "replica")):
        return route
    return NO_ROUTE


class PrefixRouter(RequestRouter):
    """Session pin, then longest cached prefix, each within `imbalance` requests of the least loaded
    replica; else the least loaded. Deliberately without Ray's FIFOMixin: that mixin may hand the
    replica chosen for one request's prefix to another queued request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.initialize_state()  # Ray calls it again with the deployment's request_router_kwargs

    def initialize_state(
        self,
        policy: str = "prefix",
        imbalance: int = 4,
        block_chars: int = 128,
        max_blocks: int = 200_000,
        max_sessions: int = 100_000,
    ) -> None:
        """Settings from RequestRouterConfig.request_router_kwargs; empty index, pins and loads."""
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: use one of {', '.join(POLICIES)}")
        if imbalance < 0 or block_chars < 1 or max_blocks < 1 or max_sessions < 1:
            raise ValueError("imbalance must be >= 0 and block_chars, max_blocks, max_sessions >= 1")
        self.policy, self.imbalance, self.block_chars = policy, imbalance, block_chars
        self.max_blocks, self.max_sessions = max_blocks, max_sessions
        self._blocks: OrderedDict[bytes, ReplicaID] = OrderedDict()  # chain hash -> newest replica to read it
        self._block_counts: dict[ReplicaID, int] = {}  # replica -> its entries in _blocks (a tie-break)
        self._sessions: OrderedDict[str, ReplicaID] = OrderedDict()
        # replica -> internal_request_id -> routed, not completed calls (their sum: its load). Keyed by
        # both: calls made while serving one request share that request's internal_request_id.
        self._calls: dict[ReplicaID, dict[str, int]] = {}
        self._early: OrderedDict[tuple[ReplicaID, str], int] = OrderedDict()
        # id(pending request) -> (replica chosen, the request): chosen, not yet accepted. Counted as load
        # so a burst of requests chosen before any is accepted spreads instead of piling onto one replica.
        self._reserved: dict[int, tuple[ReplicaID, PendingRequest]] = {}

    def load(self, replica_id: ReplicaID) -> int:
        """Requests this router chose or routed for the replica that have not completed."""
        routed = sum(self._calls.get(replica_id, {}).values())
        return routed + sum(rid == replica_id for rid, _ in self._reserved.values())

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One replica (Ray's loop asks again, after a backoff, if it turns the request away)."""
        if not candidate_replicas:
            return []
        route = route_of(pending_request)
        if route.replica is not None:
            ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[route.replica % len(ordered)]]]
        # Replicas Ray's queue-length cache knows to be full would turn the request away (and this router,
        # asked again, would pick the same one): prefer those with room while any has.
        choice = self._pick(self.select_available_replicas(candidate_replicas) or candidate_replicas, route)
        if pending_request is not None:
            self._reserve(pending_request, choice.replica_id)
        return [[choice]]

    def _reserve(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """Count the request on its replica until Ray accepts it there (a retry chooses again and replaces
        it); requests whose routing was cancelled are dropped."""
        for key, (_, pending) in list(self._reserved.items()):
            if pending.future.cancelled():
                del self._reserved[key]
        self._reserved[id(pending_request)] = (replica_id, pending_request)

    def _pick(self, candidates: list[RunningReplica], route: RouteKey) -> RunningReplica:
        by_id = {r.replica_id: r for r in candidates}
        least = min(candidates, key=self._least_loaded_key)
        if self.policy == "least_loaded":
            return least
        limit = self.load(least.replica_id) + self.imbalance
        pinned = self._pinned(route.session)
        if pinned in by_id and self.load(pinned) <= limit:
            return by_id[pinned]
        holder = self._longest_prefix_holder(route.text, by_id)
        if holder is not None and self.load(holder) <= limit:
            return by_id[holder]
        return least

    def _least_loaded_key(self, replica: RunningReplica) -> tuple:
        """Fewest in flight, then fewest indexed blocks (new prefixes spread out), then id (deterministic)."""
        rid = replica.replica_id
        return self.load(rid), self._block_counts.get(rid, 0), rid.unique_id

    def _pinned(self, session: str | None) -> ReplicaID | None:
        rid = self._sessions.get(session) if session is not None else None
        if rid is not None:
            self._sessions.move_to_end(session)
        return rid

    def _longest_prefix_holder(self, text: str, by_id: dict) -> ReplicaID | None:
        """The replica of the last block of the chain walked while its blocks' replicas are candidates."""
        matched: list[bytes] = []
        holder = None
        for h in block_hashes(text, self.block_chars):
            rid = self._blocks.get(h)
            if rid is None or rid not in by_id:
                break
            matched.append(h)
            holder = rid
        self._touch(matched)
        return holder

    def _touch(self, hashes: list[bytes]) -> None:
        """Mark blocks used, the last first: eviction then takes a chain's tail before its head, which
        only shortens the prefix that still matches."""
        for h in reversed(hashes):
            self._blocks.move_to_end(h)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """Ray accepted the request on the replica: count it, index its blocks, pin its session.

        Ray 2.60 calls this only on the rejection protocol's accept (router.py `_route_and_send_request_once`),
        i.e. for Python replicas outside Ray Client, which is how the ingress calls the engine. Other paths
        (Ray Client, Java replicas, handle.choose_replica/dispatch) never call it: their requests are
        neither counted nor indexed, and their completions are ignored."""
        self._reserved.pop(id(pending_request), None)
        route = route_of(pending_request)
        if route.replica is not None:
            return
        self._count(replica_id, pending_request.metadata.internal_request_id)
        if self.policy == "least_loaded":
            return
        self._index(block_hashes(route.text, self.block_chars), replica_id)
        if route.session is not None:
            self._sessions[route.session] = replica_id
            self._sessions.move_to_end(route.session)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def _count(self, replica_id: ReplicaID, request_id: str) -> None:
        key = (replica_id, request_id)
        if key in self._early:  # its completion came first (see on_request_completed): nothing in flight
            self._early[key] -= 1
            if not self._early[key]:
                del self._early[key]
            return
        calls = self._calls.setdefault(replica_id, {})
        calls[request_id] = calls.get(request_id, 0) + 1

    def _index(self, hashes: list[bytes], replica_id: ReplicaID) -> None:
        """The newest replica to read a prefix holds it (its cache has it most recently)."""
        for h in hashes:
            old = self._blocks.get(h)
            if old != replica_id:
                if old is not None:
                    self._add_blocks(old, -1)
                self._add_blocks(replica_id, 1)
                self._blocks[h] = replica_id
        self._touch(hashes)
        while len(self._blocks) > self.max_blocks:
            _, old = self._blocks.popitem(last=False)
            self._add_blocks(old, -1)

    def _add_blocks(self, replica_id: ReplicaID, n: int) -> None:
        count = self._block_counts.get(replica_id, 0) + n
        if count > 0:
            self._block_counts[replica_id] = count
        else:
            self._block_counts.pop(replica_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """A call on the replica ended (finished, failed, cancelled, or turned away): it no longer counts.

        Ray 2.60 calls this from the result's done-callback (router.py `_register_completion_callback`;
        for a stream, when its generator task ends, replica_result.py `add_done_callback`), including for
        a call the replica turned away (which never reached on_request_routed) and for fan-out calls.
        A completion can run before its own on_request_routed (a call that ends at once: the callback is
        queued on the loop ahead of the routing task's wake-up); such a completion is remembered, bounded,
        so the late on_request_routed does not count a call that already ended (else that replica's load
        would stay one too high for good). The price: a call turned away by a replica and then accepted by
        the same one is not counted while it runs."""
        for key, (rid, pending) in list(self._reserved.items()):  # chosen, never accepted (turned away, failed)
            if rid == replica_id and pending.metadata.internal_request_id == internal_request_id:
                del self._reserved[key]
        calls = self._calls.get(replica_id)
        if calls and internal_request_id in calls:
            self._release(replica_id, calls, internal_request_id)
            return
        key = (replica_id, internal_request_id)
        self._early[key] = self._early.get(key, 0) + 1
        self._early.move_to_end(key)
        while len(self._early) > EARLY_COMPLETIONS_KEPT:
            self._early.popitem(last=False)

    def _release(self, replica_id: ReplicaID, calls: dict[str, int], request_id: str) -> None:
        calls[request_id] -= 1
        if not calls[request_id]:
            del calls[request_id]
        if not calls:
            del self._calls[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Forget the dead replica's load (its calls' completions, if they still come, are then ignored).
        Its index entries and pins stay until evicted: lookups skip replicas that are not candidates."""
        super().on_replica_actor_died(replica_id)
        self._calls.pop(replica_id, None)
        self._reserved = {key: chosen for key, chosen in self._reserved.items() if chosen[0] != replica_id}
