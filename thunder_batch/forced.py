"""When a constrained request's forced tokens (constraints.Constraint.forced: the tokens its grammar alone allows)
are worth feeding at once (pure Python, no torch). They go in through a prefill lane, whose step costs r times a
decode-only step (r measured here: ~4 on a CPU at B=1 with 64-row lanes, ~1 where a lane's rows are nearly free, as
on a GPU). In a step of B running slots, a decode-only step gives B tokens; a lane step feeding k forced tokens and
sampling the next gives B + k in r times the time. So k forced tokens are fed at once when B + k >= r B, and sampled
one step each otherwise: the same tokens either way."""

from __future__ import annotations

import math

DECAY = 0.8  # weight of the old value in the moving averages


class ForcedTokensGate:
    """Moving averages of the step times per lane count (0: decode-only), the first of each not counted (one-off
    costs); `least` asks them how many forced tokens pay for a lane."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}  # lanes -> moving average of its steps' seconds
        self.seen: dict[int, int] = {}

    def record(self, lanes: int, seconds: float) -> None:
        self.seen[lanes] = self.seen.get(lanes, 0) + 1
        if self.seen[lanes] > 1:
            old = self.seconds.get(lanes)
            self.seconds[lanes] = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def least(self, lanes: int, running: int) -> int | None:
        """The fewest forced tokens a slot must have for a step of `lanes` lanes among `running` slots to beat
        decode-only steps (B + k >= r B), or None until both kinds of step are measured."""
        plain, wide = self.seconds.get(0), self.seconds.get(lanes)
        if plain is None or wide is None:
            return None
        return max(1, math.ceil(running * (wide / plain - 1)))
