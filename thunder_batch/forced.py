"""When a constrained request's forced tokens (constraints.Constraint.forced: the tokens its grammar alone allows)
are worth feeding at once (pure Python, no torch). They go in through a prefill lane, whose step costs r times a
decode-only step (r measured here: ~4 on a CPU at B=1 with 64-row lanes, ~1 where a lane's rows are nearly free, as
on a GPU). In a step of B running slots, a decode-only step gives B tokens; a lane step feeding k forced tokens and
sampling the next gives B + k in r times the time. So k forced tokens are fed at once when B + k >= r B, and sampled
one step each otherwise: the same tokens either way."""

from __future__ import annotations

import math
from collections.abc import Callable

from thunder_batch.drafts import moving_average


class ForcedTokensGate:
    """Moving averages of the step times per lane count (0: decode-only), the first of each not counted (one-off
    costs); `least` asks them how many forced tokens pay for a lane."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # lanes -> moving average of its steps' seconds
        self.seen: dict[int, int] = {}

    def record(self, lanes: int, seconds: float) -> None:
        self.seen[lanes] = self.seen.get(lanes, 0) + 1
        if self.seen[lanes] > 1:
            self.seconds[lanes] = moving_average(self.seconds.get(lanes), seconds)

    def least(self, lanes: int, running: int) -> int | None:
        """The fewest forced tokens a slot must have for a step of `lanes` lanes among `running` slots to beat
        decode-only steps (B + k >= r B), or None until both kinds of step are measured."""
        plain, wide = self.seconds.get(0), self.seconds.get(lanes)
        if plain is None or wide is None:
            return None
        return max(1, math.ceil(running * (wide / plain - 1)))


class ForcedTokens:
    """The engine's side: which forced tokens a request takes after a step (`after`), from the config and the
    gate, which every step's time feeds (`record`)."""

    def __init__(self, config) -> None:
        self.config, self.gate = config, ForcedTokensGate()

    def record(self, plan, seconds: float) -> None:
        if not plan.verify:
            self.gate.record(plan.busy_lanes, seconds)

    def after(self, request, token: int, tops: bool, running: Callable[[], int]) -> list[tuple]:
        """(token, logprob, alternatives) of each token the request's grammar alone allows after `token`, just
        sampled, where feeding them at once pays (always with forced_tokens=True): logprob log 1 = 0 and the
        token its only alternative, as a masked head gives it. running(): the busy slots, asked only by the gate
        (every sampled row of every step comes here)."""
        cfg = self.config
        if request.constraint is None or cfg.forced_tokens is False or token in request.stop_ids or not cfg.lane_counts:
            return []
        least = 1 if cfg.forced_tokens else self.gate.least(cfg.lanes_for(1), running())
        if least is None:
            return []
        limit = min(request.params.max_new_tokens - len(request.output_ids) - 1, cfg.prefill_chunk - 1)
        forced = request.constraint.forced([*request.output_ids, token], limit, least)
        return [(t, 0.0, [(t, 0.0)] if tops else None) for t in forced]
