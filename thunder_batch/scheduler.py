"""Waiting queue, slot free-list and the per-step plan (pure Python: no torch)."""

from __future__ import annotations

import itertools
from collections import deque

from thunder_batch.prefix_store import PrefixStore, common_prefix
from thunder_batch.request import Request, StepOutput
from thunder_batch.step_plan import PrefixCopy, PrefixRestore, PrefixSave, SlotWork, StepPlan


class Scheduler:
    """Admits waiting requests into free slots (FIFO) and plans each step.

    With `prefix_reuse`, a slot keeps the token ids of the cache entries its last request wrote
    (`kept`): a slot is reused without clearing, and an entry depends only on the tokens up to it, so
    a new prompt sharing k of them needs only the rest fed (at least its last token, whose logits give
    the first sample). Admission takes the free slot sharing the longest prefix (ties: the least
    recently used), and copies a longer prefix from another slot, busy or free, when it saves at least
    `copy_min` tokens. A request waits while a slot still reading its prompt will soon hold a chunk
    or more of its prefix, `copy_min` more than any slot holds now (a burst sharing one system prompt
    reads it once). Requests asking for prompt logprobs feed every prompt token. With `store_tokens`,
    kept entries about to be written over are saved to host memory first, up to that many tokens in
    all, and restored into the slot of a prompt sharing more of them than any slot holds (prefix_store).

    A decoding slot (one pending token) feeds it through its decode row, every step: decode never
    pauses. Slots with prompt left take prefill lanes in admission order, up to `chunk` tokens each
    per step (a long prompt spans several steps). `lane_counts` are the lane counts a step may have
    (the config's); a step opens the largest count that every lane fills (the smallest while fewer
    slots have prompt left), so wide steps carry real prompt tokens only; the other slots wait for a
    lane. With no lane counts, prompts go in one token per step through the decode rows.
    """

    def __init__(
        self,
        num_slots: int,
        chunk: int,
        lane_counts: tuple[int, ...] = (),
        prefix_reuse: bool = False,
        copy_min: int = 1,
        store_tokens: int = 0,
    ) -> None:
        self.chunk, self.lane_counts = chunk, lane_counts
        self.prefix_reuse, self.copy_min = prefix_reuse, copy_min
        self.store = PrefixStore(store_tokens) if prefix_reuse and store_tokens else None
        self.slots: list[Request | None] = [None] * num_slots
        self.waiting: deque[Request] = deque()
        self._admitted = itertools.count()
        self._admission: dict[int, int] = {}  # slot -> admission order of its request
        self.kept: list[list[int]] = [[] for _ in range(num_slots)]  # free slot -> ids of its valid entries
        self._released = [0] * num_slots  # when each slot was last freed (0: never): least recently used first
        self._clock = itertools.count(1)
        self._untrusted: set[int] = set()  # busy slots whose entries no other request may take
        self.prompt_tokens_looked_up = 0  # prompt tokens of the requests admitted with a prefix lookup
        self.prompt_tokens_reused = 0  # of those, tokens taken from a slot's cache instead of computed

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

    def remove(self, request: Request, keep: bool = True) -> None:
        """Take a request out of the queue or free its slot (finished, or aborted: `keep` False drops
        the tokens its slot would keep)."""
        if request.slot is not None:
            slot = request.slot
            trusted = keep and self.prefix_reuse and slot not in self._untrusted
            self.kept[slot] = cached_ids(request) if trusted else []
            self._untrusted.discard(slot)
            self._released[slot] = next(self._clock)
            self.slots[slot] = None
            request.slot = None
        elif request in self.waiting:
            self.waiting.remove(request)

    def postprocess(self, work: SlotWork, sampled: list[tuple]) -> list[StepOutput]:
        """After a step, one slot's work: its tokens are in the slot's cache, and the tokens sampled after them,
        (token, logprob, alternatives), are appended one by one up to the one that finishes the request (a
        verify lane's cache keeps its pending token and the accepted drafts appended); a finished request
        leaves its slot. Returns each appended token's StepOutput."""
        request = work.request
        if not work.draft:
            request.num_cached += len(work.token_ids)
        outputs = []
        for token, logprob, top in sampled:
            outputs.append(request.append(token, logprob, top))
            if request.finished:
                break
        if work.draft:
            request.num_cached += len(outputs)
        if request.finished:
            self.remove(request)
        return outputs

    def drop_kept(self) -> None:
        """Forget every slot's kept tokens and every stored prefix (weights changed, a step failed): free
        slots' now, busy slots' as sources at once and as kept tokens when they are freed."""
        self.kept = [[] for _ in self.slots]
        if self.store is not None:
            self.store.clear()
        self._untrusted = {slot for slot, r in enumerate(self.slots) if r is not None}

    def step_failed(self, plan: StepPlan) -> None:
        """After a step that raised: its copies may be partial, so their requests compute those entries."""
        for copy in plan.copies:
            if isinstance(copy, PrefixSave):
                continue
            request = self.slots[copy.dst]
            if request is not None and request.num_cached == copy.end:
                request.num_cached = copy.start
                self.prompt_tokens_reused -= copy.end - copy.start
        self.drop_kept()

    def schedule(self) -> StepPlan | None:
        """Admit into free slots, then plan one step; None when there is nothing to run."""
        copies = self._admit()
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
        if not work:
            return None
        dropped = self.store.take_dropped() if self.store is not None else ()  # freed by this plan's runner call
        return StepPlan(work, tuple(copies), dropped=dropped)

    def _lanes_open(self, prefilling: int) -> int:
        """Lanes for this step: the largest lane count that `prefilling` slots fill, at least the first."""
        if not self.lane_counts:
            return 0
        return max([c for c in self.lane_counts if c <= prefilling] or [self.lane_counts[0]])

    def _admit(self) -> list[PrefixCopy]:
        """Fill free slots from the queue in order (FIFO; a request waiting for a prefix keeps its place)."""
        free = [slot for slot, occupant in enumerate(self.slots) if occupant is None]
        copies, held = [], []
        while free and self.waiting:
            request = self.waiting.popleft()
            if not self.prefix_reuse:
                self._place(request, free.pop(0))
            elif self._wait_for_prefix(request):
                held.append(request)
            else:
                copies += self._place_reusing(request, free)
        self.waiting.extendleft(reversed(held))
        return copies

    def _place(self, request: Request, slot: int) -> None:
        request.slot = slot
        self.slots[slot] = request
        self._admission[slot] = next(self._admitted)
        self.kept[slot] = []  # busy: its request's cached_ids tell what it holds

    def _place_reusing(self, request: Request, free: list[int]) -> list:
        """Admit into the free slot sharing the longest prefix (ties: least recently used), from that
        point; copy a longer prefix from another slot or the store if it saves `copy_min` tokens. The
        slot's kept entries past the shared part are saved to the store first."""
        limit = reusable(request)
        slot, start = max(
            ((s, common_prefix(self.kept[s], request.prompt_ids, limit)) for s in free),
            key=lambda pair: (pair[1], -self._released[pair[0]], -pair[0]),
        )
        free.remove(slot)
        copies = self._save_kept(slot, start)
        src, end = self._best_source(request, exclude=slot)
        entry, stored = self.store.longest(request.prompt_ids, limit) if self.store is not None else (None, 0)
        if stored > end and stored - start >= self.copy_min:
            self.store.use(entry)
            copies.append(PrefixRestore(entry, slot, start, stored))
            start = stored
        elif end - start >= self.copy_min:
            copies.append(PrefixCopy(src, slot, start, end))
            start = end
        self._place(request, slot)
        request.num_cached = start
        self.prompt_tokens_looked_up += len(request.prompt_ids)
        self.prompt_tokens_reused += start
        return copies

    def _save_kept(self, slot: int, shared: int) -> list[PrefixSave]:
        """Save a free slot's kept entries before a prompt sharing only `shared` of them writes over the rest."""
        kept = self.kept[slot]
        if self.store is None or len(kept) - shared < self.copy_min:
            return []
        entry = self.store.add(kept)
        return [] if entry is None else [PrefixSave(slot, entry, len(kept))]

    def _sources(self, exclude: int | None = None):
        """(slot, token ids its first entries hold) of every slot a prompt may copy from."""
        for slot, request in enumerate(self.slots):
            if slot == exclude or slot in self._untrusted:
                continue
            yield slot, self.kept[slot] if request is None else cached_ids(request)

    def _best_source(self, request: Request, exclude: int | None = None) -> tuple[int, int]:
        """(slot, length) of the longest prefix of the prompt another slot holds ((-1, 0): none)."""
        limit = reusable(request)
        best = (-1, 0)
        for slot, ids in self._sources(exclude):
            length = common_prefix(ids, request.prompt_ids, limit)
            if length > best[1]:
                best = (slot, length)
        return best

    def _wait_for_prefix(self, request: Request) -> bool:
        """Whether a slot still reading its prompt will hold at least a chunk of this prompt's prefix,
        and `copy_min` more of it than any slot holds now: wait for it rather than compute the prefix
        twice (a shorter one, such as a chat template's header, is not worth a step's wait)."""
        limit = reusable(request)
        soon = max(
            (
                common_prefix(r.prompt_ids, request.prompt_ids, limit)
                for s, r in enumerate(self.slots)
                if r is not None and s not in self._untrusted and r.num_cached < len(r.prompt_ids)
            ),
            default=0,
        )
        held = max(self._best_source(request)[1], self.store.longest(request.prompt_ids, limit)[1] if self.store else 0)
        return soon >= self.chunk and soon - held >= self.copy_min

    def _lane_work(self, lane: int, slot: int, request: Request) -> SlotWork:
        pending = request.pending_ids()
        feed = pending[: self.chunk]
        return SlotWork(slot, request, feed, request.num_cached, samples=len(feed) == len(pending), lane=lane)


def cached_ids(request: Request) -> list[int]:
    """Token ids of the cache entries a request has written, by position (prompt, then output: a stop
    that cut output tokens cut a suffix, so what remains still matches the entries)."""
    return (request.prompt_ids + request.output_ids)[: request.num_cached]


def reusable(request: Request) -> int:
    """How many prompt tokens may come from a cache: all but the last (its logits give the first
    sample); none when the prompt's own logprobs are asked for (every prompt row is scored)."""
    return 0 if request.params.prompt_logprobs is not None else len(request.prompt_ids) - 1
