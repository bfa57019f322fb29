"""Speculative decoding's host side (pure Python: no torch): prompt-lookup drafts per slot, the gate
that checks only the drafts whose expected accepted tokens pay for their rows, and the acceptance rule
that keeps outputs those of plain decoding.

A decoding slot whose last n tokens (n from `ngram_max` down to `ngram_min`) occurred earlier in its
prompt or output proposes the up-to-k tokens that followed their most recent occurrence (vLLM's
`ngram` method). The engine turns a plan whose slots all decode into a verify step (`StepPlan.verify`):
each drafting slot feeds its last token and its draft through a verify lane of k + 1 rows, and every
row samples the token at its position (`accepted_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from thunder_batch.logit_controls import has_controls
from thunder_batch.step_plan import SlotWork, StepPlan

GATE_DECAY = 0.8  # weight of the old value in the gate's moving averages
GATE_MIN_STEPS = 2  # timed steps of a kind (after its first: one-off costs) before the gate trusts its time
# A verify step must promise this many times plain decoding's tokens per time: the slots chosen are those
# whose estimates are highest (so, on average, too high), and a step's time varies from step to step.
GATE_MARGIN = 1.1
PRIOR_ACCEPTED = 1.0  # expected accepted drafts of a verify lane before any lane was checked


def moving_average(old: float | None, new: float) -> float:
    """GATE_DECAY of the old value (None: none yet) and the rest of the new one."""
    return new if old is None else GATE_DECAY * old + (1 - GATE_DECAY) * new


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


class StepCosts:
    """What a verify step costs, in plain decode steps: moving averages of the plain steps' time and of
    each verify lane count's time over it. The first step of each kind is not counted (one-off costs)."""

    def __init__(self) -> None:
        self.plain: float | None = None  # seconds
        self.ratios: dict[int, float] = {}  # verify lane count -> its time / a plain step's
        self.counts: dict[object, int] = defaultdict(int)  # "plain" or a verify lane count -> steps seen

    def record(self, kind, seconds: float) -> None:
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            return
        if kind == "plain":
            self.plain = moving_average(self.plain, seconds)
        elif self.plain is not None:
            self.ratios[kind] = moving_average(self.ratios.get(kind), seconds / self.plain)

    def trusted(self, kind) -> bool:
        measured = self.plain is not None if kind == "plain" else kind in self.ratios
        return measured and self.counts[kind] > GATE_MIN_STEPS

    def ratio(self, lanes: int) -> float | None:
        """A verify step of `lanes` lanes in plain steps: measured, else from the widest count measured
        below it, linear in lanes (dearer than the truth where a step has a fixed cost besides its rows:
        wider steps are tried only where they would pay at that price); None when nothing below it is."""
        if self.trusted(lanes):
            return self.ratios[lanes]
        below = [c for c in self.ratios if c < lanes and self.trusted(c)]
        if not below:
            return None
        widest = max(below)
        return 1 + (self.ratios[widest] - 1) * lanes / widest


class DraftGate:
    """Which drafting slots a step checks: the ones whose expected accepted drafts pay for the rows they
    add. With `busy` slots sampling, checking the first n of the drafting slots (most expected first)
    gives busy + their expected accepted drafts in the time of ratio(lanes for n) plain steps; the gate
    takes the n with the most tokens per plain step's time, none unless that beats plain decoding by
    GATE_MARGIN.
    Measuring comes first: plain steps, then one verify lane (the cheapest shape to try). Outputs never
    depend on it: it decides only which steps pay for extra rows."""

    def __init__(self) -> None:
        self.costs = StepCosts()

    def record(self, kind, seconds: float) -> None:
        """A decode step's time: kind "plain", or the verify lane count of a verify step."""
        self.costs.record(kind, seconds)

    def choose(self, busy: int, expected: list[tuple[int, float]], lanes_for) -> list[int]:
        """Slots to check, from `expected`: (slot, expected accepted drafts), most first."""
        if not expected or not self.costs.trusted("plain"):
            return []
        if self.costs.ratio(1) is None:  # measure one lane first
            return [expected[0][0]] if expected[0][1] > 0 else []
        best, best_rate, total = 0, busy * GATE_MARGIN, 0.0  # rate: tokens per plain step's time
        for n, (_, accepted) in enumerate(expected, start=1):
            total += accepted
            ratio = self.costs.ratio(lanes_for(n))
            if ratio is None:
                break
            if (busy + total) / ratio > best_rate:
                best, best_rate = n, (busy + total) / ratio
        return [slot for slot, _ in expected[:best]]


class Acceptance:
    """Expected accepted drafts of a request's next verify lane: a moving average over its own lanes. It
    starts from, and while its drafts go unchecked moves back towards, the average over every request's
    lanes, or PRIOR_ACCEPTED if that is higher: a new request, or one whose drafts failed a while ago, is
    tried (again) where one accepted draft would pay, whatever earlier requests kept."""

    def __init__(self) -> None:
        self.overall = PRIOR_ACCEPTED
        self.requests: dict[object, float] = {}

    @property
    def prior(self) -> float:
        return max(self.overall, PRIOR_ACCEPTED)

    def expected(self, request_id, draft_len: int) -> float:
        return min(self.requests.get(request_id, self.prior), draft_len)

    def record(self, request_id, accepted: int) -> None:
        self.requests[request_id] = moving_average(self.requests.get(request_id, self.prior), accepted)
        self.overall = moving_average(self.overall, accepted)

    def unchecked(self, request_id) -> None:
        if request_id in self.requests:
            self.requests[request_id] = moving_average(self.requests[request_id], self.prior)

    def finished(self, request_id) -> None:
        self.requests.pop(request_id, None)


class Drafter:
    """Turns a step plan whose slots all decode into a verify plan for the drafting slots the gate
    chooses, and keeps what the gate weighs (step times, acceptance) and the counters (drafts proposed /
    accepted, verify steps)."""

    def __init__(self, config) -> None:
        self.k, self.ngram_min, self.ngram_max = (
            config.speculative_tokens,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
        )
        self.config = config
        self.gate = DraftGate()
        self.acceptance = Acceptance()
        self.counters = dict(verify_steps=0, draft_tokens=0, accepted_tokens=0)

    def propose(self, plan: StepPlan) -> StepPlan:
        """`plan` itself, or the same work with the chosen drafting slots moved into verify lanes."""
        if not self.k or not all(w.lane is None and (w.samples or not _scores(w)) for w in plan.work):
            return plan
        sampling = [w for w in plan.work if w.samples]
        drafts = {w.slot: draft for w in sampling if (draft := self._draft(w))}
        if not drafts:
            return plan
        ids = {w.slot: w.request.request_id for w in sampling}
        expected = sorted(
            ((slot, self.acceptance.expected(ids[slot], len(draft))) for slot, draft in drafts.items()),
            key=lambda pair: -pair[1],
        )
        chosen = self.gate.choose(len(sampling), expected, self.config.verify_lanes_for)
        for slot in drafts.keys() - set(chosen):
            self.acceptance.unchecked(ids[slot])
        if not chosen:
            return plan
        lanes = {slot: lane for lane, slot in enumerate(sorted(chosen))}
        work = [
            dataclasses.replace(w, token_ids=w.token_ids + drafts[w.slot], lane=lanes[w.slot], draft=drafts[w.slot])
            if w.slot in lanes
            else w
            for w in plan.work
        ]
        self.counters["verify_steps"] += 1
        return dataclasses.replace(plan, work=work, verify=True)

    def _draft(self, work: SlotWork) -> list[int]:
        request = work.request
        if has_controls(request.params):  # a verify row's controls would need the counts of the drafts before it
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
        self.acceptance.record(work.request.request_id, accepted)

    def finished(self, request_id) -> None:
        self.acceptance.finished(request_id)

    def stats(self) -> dict:
        """Counters only (the server sums them over workers): acceptance = accepted / draft tokens."""
        return dict(self.counters)


def _scores(work: SlotWork) -> bool:
    """Whether a work scores prompt tokens (prompt logprobs): such steps are never verify steps."""
    request = work.request
    return request.params.prompt_logprobs is not None and work.start_pos < len(request.prompt_ids) - 1
