"""What one step feeds (pure Python, no torch): each slot's work, the cache copies done before it. The
scheduler makes a StepPlan, the runner turns it into the step's tensors; only these types are shared, so the
compile cache's key (the bytes of what the runner imports: compile/provenance.py) covers no scheduling code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # an annotation only: no import edge for the compile cache's key
    from thunder_batch.request import Request


@dataclass(frozen=True)
class SlotWork:
    """Tokens one slot feeds this step, from position `start_pos`: one token through the slot's
    decode row (`lane` None), or up to a chunk through prefill lane `lane`. `samples` is True when
    they are all of the request's pending tokens, so the token sampled after them is a real output.
    In a verify step (`StepPlan.verify`) a drafting slot's `lane` is a verify lane and `token_ids` are
    its pending token then `draft`, the guessed tokens after it (see drafts.py)."""

    slot: int
    request: Request
    token_ids: list[int]
    start_pos: int
    samples: bool
    lane: int | None = None
    draft: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PrefixCopy:
    """Cache entries `start .. end-1` of slot `src` copied into slot `dst` before the step (every layer's
    K and V): a prompt prefix another slot already holds, not computed again."""

    src: int
    dst: int
    start: int
    end: int


@dataclass(frozen=True)
class PrefixSave:
    """Cache entries 0 .. end-1 of slot `src` copied to host memory as stored prefix `entry`, before the
    step (and before any copy into `src`): the slot's kept entries, about to be written over."""

    src: int
    entry: int
    end: int


@dataclass(frozen=True)
class PrefixRestore:
    """Entries `start .. end-1` of stored prefix `entry` copied into slot `dst` before the step."""

    entry: int
    dst: int
    start: int
    end: int


@dataclass(frozen=True)
class StepPlan:
    work: list[SlotWork]
    copies: tuple[PrefixCopy | PrefixSave | PrefixRestore, ...] = ()  # done, in order, before the step runs
    verify: bool = False  # lanes are verify lanes (drafts checked), not prefill lanes
    dropped: tuple[int, ...] = ()  # stored prefixes to free once the copies are done

    @property
    def busy_lanes(self) -> int:
        """Prefill (or verify) lanes this step feeds (0: every slot feeds its decode row)."""
        return sum(w.lane is not None for w in self.work)

    @property
    def span(self) -> int:
        """Cache entries this step must read: every fed token's position is below it."""
        return max((w.start_pos + len(w.token_ids) for w in self.work), default=1)
