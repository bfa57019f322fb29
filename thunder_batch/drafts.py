"""Speculative decoding's host side (pure Python: no torch): prompt-lookup drafts per slot, the
per-slot pause after rejected drafts, the gate that skips drafting where verify steps do not pay,
and the acceptance rule that keeps outputs those of plain decoding.

A decoding slot whose last n tokens (n from `ngram_max` down to `ngram_min`) occurred earlier in its
prompt or output proposes the up-to-k tokens that followed their most recent occurrence (vLLM's
`ngram` method). The engine turns a plan whose slots all decode into a verify step (`StepPlan.verify`):
each drafting slot feeds its last token and its draft through a verify lane of k + 1 rows, and every
row samples the token at its position (`accepted_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from thunder_batch.scheduler import SlotWork, StepPlan

PAUSE_AFTER = 2  # drafts rejected in a row before a slot pauses drafting
MAX_PAUSE = 32  # steps: the longest pause (it doubles with each further rejection)
GATE_MIN_STEPS = 4  # steps of each kind measured before the gate compares them
GATE_RETRY = 64  # steps without drafting, once the gate closed, before verify steps are tried again
GATE_DECAY = 0.8  # weight of the old rate in the gate's moving averages


def prompt_lookup(history: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of
    `history` (the longest n in [ngram_min, ngram_max] that occurs); [] when none does."""
    size = len(history)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = history[size - n :]
        last = tail[-1]
        # An occurrence ending at i (exclusive) must leave a token after it: i < size.
        for end in range(size - 1, n - 1, -1):
            if history[end - 1] == last and history[end - n : end] == tail:
                return history[end : end + k]
    return []


def accepted_tokens(draft: list[int], samples: list[int]) -> list[int]:
    """The tokens a verify lane gives: row j fed the token before draft[j] and sampled `samples[j]`,
    the token plain decoding samples there given the same prefix; draft[j] stands while it equals
    that sample, so the tokens are the accepted drafts and the first sample after them."""
    tokens = [samples[0]]
    for j, guess in enumerate(draft):
        if guess != samples[j]:
            break
        tokens.append(samples[j + 1])
    return tokens


class SlotPause:
    """A slot whose drafts keep being rejected stops drafting for a while: after PAUSE_AFTER rejected
    drafts in a row, 2, 4, ... up to MAX_PAUSE steps. Any accepted token ends the streak."""

    def __init__(self) -> None:
        self.rejected_in_a_row = 0
        self.paused_until = 0

    def record(self, step: int, accepted: int) -> None:
        if accepted:
            self.rejected_in_a_row = 0
            return
        self.rejected_in_a_row += 1
        if self.rejected_in_a_row >= PAUSE_AFTER:
            self.paused_until = step + min(2 ** (self.rejected_in_a_row - PAUSE_AFTER + 1), MAX_PAUSE)

    def paused(self, step: int) -> bool:
        return step < self.paused_until


class DraftGate:
    """Skips drafting while verify steps of a shape give fewer tokens per second than plain steps
    (moving averages per verify lane count); after GATE_RETRY steps it tries them again. Outputs never
    depend on it: it decides only which steps pay for extra rows."""

    def __init__(self) -> None:
        self.rates: dict[object, float] = {}  # "plain" or a verify lane count -> tokens per second
        self.counts: dict[object, int] = defaultdict(int)
        self.closed_at: dict[int, int] = {}  # verify lane count -> step it was closed at

    def record(self, kind, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-9)
        old = self.rates.get(kind)
        self.rates[kind] = rate if old is None else GATE_DECAY * old + (1 - GATE_DECAY) * rate
        self.counts[kind] += 1

    def allows(self, lanes: int, step: int) -> bool:
        closed = self.closed_at.get(lanes)
        if closed is not None:
            if step - closed < GATE_RETRY:
                return False
            del self.closed_at[lanes]
            self.counts[lanes] = 0  # measured afresh
            self.rates.pop(lanes, None)
        if min(self.counts["plain"], self.counts[lanes]) < GATE_MIN_STEPS:
            return True
        if self.rates[lanes] < self.rates["plain"]:
            self.closed_at[lanes] = step
            return False
        return True


class Drafter:
    """Turns a step plan whose slots all decode into a verify plan when some slot has a draft, and
    keeps each slot's pause and the counters (drafts proposed / accepted, verify steps)."""

    def __init__(self, config) -> None:
        self.k, self.ngram_min, self.ngram_max = (
            config.speculative_tokens,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
        )
        self.config = config
        self.gate = DraftGate()
        self.pauses: dict[object, SlotPause] = {}  # request id -> its pause
        self.steps = 0
        self.counters = dict(verify_steps=0, draft_tokens=0, accepted_tokens=0)

    def propose(self, plan: StepPlan) -> StepPlan:
        """`plan` itself, or the same work with drafting slots moved into verify lanes."""
        self.steps += 1
        if not self.k or not all(w.lane is None and (w.samples or not _scores(w)) for w in plan.work):
            return plan
        drafts = {w.slot: self._draft(w) for w in plan.work if w.samples}
        drafting = [slot for slot, draft in drafts.items() if draft]
        if not drafting or not self.gate.allows(self.config.verify_lanes_for(len(drafting)), self.steps):
            return plan
        lanes = {slot: lane for lane, slot in enumerate(sorted(drafting))}
        work = [
            dataclasses.replace(w, token_ids=w.token_ids + drafts[w.slot], lane=lanes[w.slot], draft=drafts[w.slot])
            if w.slot in lanes
            else w
            for w in plan.work
        ]
        self.counters["verify_steps"] += 1
        return StepPlan(work, plan.copies, verify=True)

    def _draft(self, work: SlotWork) -> list[int]:
        request = work.request
        pause = self.pauses.setdefault(request.request_id, SlotPause())
        if pause.paused(self.steps):
            return []
        # Room: every fed position below max_seq_length, no more tokens than the request may still produce.
        left = request.params.max_new_tokens - len(request.output_ids)
        room = min(self.k, left - 1, self.config.max_seq_length - 1 - work.start_pos)
        if room <= 0:
            return []
        return prompt_lookup(request.prompt_ids + request.output_ids, room, self.ngram_min, self.ngram_max)

    def record(self, work: SlotWork, accepted: int) -> None:
        """After a verify step: `accepted` of the work's draft tokens stood."""
        self.counters["draft_tokens"] += len(work.draft)
        self.counters["accepted_tokens"] += accepted
        self.pauses.setdefault(work.request.request_id, SlotPause()).record(self.steps, accepted)

    def finished(self, request_id) -> None:
        self.pauses.pop(request_id, None)

    def stats(self) -> dict:
        """Counters only (the server sums them over workers): acceptance = accepted / draft tokens."""
        return dict(self.counters)


def _scores(work: SlotWork) -> bool:
    """Whether a work scores prompt tokens (prompt logprobs): such steps are never verify steps."""
    request = work.request
    return request.params.prompt_logprobs is not None and work.start_pos < len(request.prompt_ids) - 1
