"""Waiting queue, slot free-list and the per-step plan (pure Python: no torch)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from thunder_batch.request import Request


@dataclass(frozen=True)
class SlotWork:
    """Tokens one slot feeds this step, from position `start_pos`; `samples` is True when they
    are all of the request's pending tokens, so the token sampled after them is a real output."""

    slot: int
    request: Request
    token_ids: list[int]
    start_pos: int
    samples: bool


@dataclass(frozen=True)
class StepPlan:
    width: int  # T of this step: the prefill chunk while any slot prefills, else 1
    work: list[SlotWork]


class Scheduler:
    """Admits waiting requests into free slots (FIFO) and plans each step.

    A slot with prompt left feeds up to `chunk` tokens; a decoding slot feeds its last token.
    Both kinds share one step, so decoding never pauses while another slot prefills.
    """

    def __init__(self, num_slots: int, chunk: int) -> None:
        self.chunk = chunk
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: deque[Request] = deque()

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
        work = [self._work_for(slot, r) for slot, r in enumerate(self.slots) if r is not None]
        if not work:
            return None
        width = self.chunk if any(len(w.token_ids) > 1 for w in work) else 1
        return StepPlan(width, work)

    def _admit(self) -> None:
        for slot, occupant in enumerate(self.slots):
            if occupant is None and self.waiting:
                request = self.waiting.popleft()
                request.slot = slot
                self.slots[slot] = request

    def _work_for(self, slot: int, request: Request) -> SlotWork:
        pending = request.pending_ids()
        feed = pending[: self.chunk]
        return SlotWork(slot, request, feed, request.num_cached, samples=len(feed) == len(pending))
