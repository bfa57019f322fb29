"""Waiting queue, slot free-list and the per-step plan (pure Python: no torch)."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from thunder_batch.request import Request


@dataclass(frozen=True)
class SlotWork:
    """Tokens one slot feeds this step, from position `start_pos`: one token through the slot's
    decode row (`lane` None), or up to a chunk through prefill lane `lane`. `samples` is True when
    they are all of the request's pending tokens, so the token sampled after them is a real output."""

    slot: int
    request: Request
    token_ids: list[int]
    start_pos: int
    samples: bool
    lane: int | None = None


@dataclass(frozen=True)
class StepPlan:
    work: list[SlotWork]

    @property
    def busy_lanes(self) -> int:
        """Prefill lanes this step feeds (0: every slot feeds its decode row)."""
        return sum(w.lane is not None for w in self.work)

    @property
    def span(self) -> int:
        """Cache entries this step must read: every fed token's position is below it."""
        return max((w.start_pos + len(w.token_ids) for w in self.work), default=1)


class Scheduler:
    """Admits waiting requests into free slots (FIFO) and plans each step.

    A decoding slot (one pending token) feeds it through its decode row, every step: decode never
    pauses. Slots with prompt left take prefill lanes in admission order, up to `chunk` tokens each
    per step (a long prompt spans several steps). `lane_counts` are the lane counts a step may have
    (the config's); a step opens the largest count that every lane fills (the smallest while fewer
    slots have prompt left), so wide steps carry real prompt tokens only; the other slots wait for a
    lane. With no lane counts, prompts go in one token per step through the decode rows.
    """

    def __init__(self, num_slots: int, chunk: int, lane_counts: tuple[int, ...] = ()) -> None:
        self.chunk, self.lane_counts = chunk, lane_counts
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: deque[Request] = deque()
        self._admitted = itertools.count()
        self._admission: dict[int, int] = {}  # slot -> admission order of its request

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def find(self, request_id) -> Request | None:
        for request in [*self.waiting, *self.slots]:
            if request is not None and request.request_id == request_id:
                return request
        return None

    def remove(self, request: Request) -> None:
        """Take a request out of the queue or free its slot (finished or aborted)."""
        if request.slot is not None:
            self.slots[request.slot] = None
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> StepPlan | None:
        """Admit into free slots, then plan one step; None when there is nothing to run."""
        self._admit()
        prefilling = []
        work = []
        for slot, request in enumerate(self.slots):
            if request is None:
                continue
            pending = request.pending_ids()
            if len(pending) == 1 or not self.lane_counts:
                work.append(SlotWork(slot, request, pending[:1], request.num_cached, samples=len(pending) == 1))
            else:
                prefilling.append(slot)
        prefilling.sort(key=self._admission.__getitem__)
        for lane, slot in enumerate(prefilling[: self._lanes_open(len(prefilling))]):
            work.append(self._lane_work(lane, slot, self.slots[slot]))
        return StepPlan(work) if work else None

    def _lanes_open(self, prefilling: int) -> int:
        """Lanes for this step: the largest lane count that `prefilling` slots fill, at least the first."""
        if not self.lane_counts:
            return 0
        return max([c for c in self.lane_counts if c <= prefilling] or [self.lane_counts[0]])

    def _admit(self) -> None:
        for slot, occupant in enumerate(self.slots):
            if occupant is None and self.waiting:
                request = self.waiting.popleft()
                request.slot = slot
                self.slots[slot] = request
                self._admission[slot] = next(self._admitted)

    def _lane_work(self, lane: int, slot: int, request: Request) -> SlotWork:
        pending = request.pending_ids()
        feed = pending[: self.chunk]
        return SlotWork(slot, request, feed, request.num_cached, samples=len(feed) == len(pending), lane=lane)
