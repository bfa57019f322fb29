"""Watching the engine's steps: each step's plan, shape and seconds, handed to whoever asked (the server's
metrics, the benchmarks), so no caller wraps or replaces the engine's methods (pure Python: no torch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from thunder_batch.config import StepShape
    from thunder_batch.request import StepOutput
    from thunder_batch.step_plan import StepPlan


@dataclass(frozen=True)
class StepEvent:
    """One step the engine ran. A probe step (`Engine.probe_step`) has an empty plan and no outputs."""

    plan: StepPlan  # what each slot fed, the cache copies before it
    shape: StepShape  # its prefill (or verify) lanes and the cache entries it read
    shape_name: str  # the shape as the metrics and reports name it (StepShape.describe)
    schedule_seconds: float  # planning it: admission, prefix matching, drafts
    inputs_seconds: float  # building its input tensors (part of `seconds`)
    seconds: float  # running it: the step program, its inputs and the cache copies before it
    outputs: tuple[StepOutput, ...] = ()  # what it produced


class Observers:
    """Callables each given every StepEvent, in the order they were added."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[StepEvent], None]] = []

    def add(self, callback: Callable[[StepEvent], None]) -> Callable[[StepEvent], None]:
        self._callbacks.append(callback)
        return callback

    def remove(self, callback: Callable[[StepEvent], None]) -> None:
        self._callbacks.remove(callback)

    def notify(self, event: StepEvent) -> None:
        for callback in list(self._callbacks):
            callback(event)
