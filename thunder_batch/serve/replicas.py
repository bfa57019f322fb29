"""One engine replica of `thunder-batch serve --replicas N`, without Ray: what a Ray Serve replica runs.

It is the LitServe worker's EngineAPI (prepare, admit, step, cancel, the same messages) over a shared
state and cancel board of its own, driven from the replica's event loop instead of LitServe's queue:
`generate(payload)` admits one request and yields its messages as (message, last) pairs; a step task
runs `EngineAPI.step` back to back while any request is in flight and sleeps on an event otherwise,
so an idle replica costs nothing; woken, it waits for a burst's other requests as a LitServe worker
does. A reader that stops reading (its client hung up: Ray cancels the generator) posts a cancel, which
the next step applies (its slot is freed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator

from thunder_batch.serve.cancels import CancelBoard
from thunder_batch.serve.loop import GATHER_S
from thunder_batch.serve.openai import APIError
from thunder_batch.serve.shared_state import UNHEALTHY_AFTER_FAILED_STEPS, SharedState
from thunder_batch.serve.worker import EngineAPI

logger = logging.getLogger(__name__)


class EngineReplica:
    """An Engine serving requests handed to it one call each (a Ray Serve replica's body)."""

    def __init__(self, api: EngineAPI) -> None:
        """api: an EngineAPI whose engine is attached (`EngineAPI.start` or `attach`)."""
        self.api = api
        self._readers: dict[str, asyncio.Queue] = {}
        self._order: asyncio.Lock | None = None  # made on the replica's own event loop
        self._wake: asyncio.Event | None = None
        self._steps: asyncio.Task | None = None

    @classmethod
    def build(cls, options, model: str, device: str = "cpu") -> EngineReplica:
        """Load and warm up the engine `options` describe, on its own engine thread (as a LitServe worker)."""
        api = EngineAPI(options, None, SharedState(1, 1), CancelBoard(), model)
        api.start(device)
        return cls(api)

    def _loop_objects(self) -> tuple[asyncio.Lock, asyncio.Event]:
        if self._order is None:
            self._order, self._wake = asyncio.Lock(), asyncio.Event()
        return self._order, self._wake

    async def generate(self, payload: dict) -> AsyncIterator[tuple[dict, bool]]:
        """One request's messages (see `EngineAPI`): "accepted" or an error, then its deltas; `last` marks
        its final message. Closing the generator early cancels the request."""
        order, wake = self._loop_objects()
        uid, reader, last, admitting = uuid.uuid4().hex, asyncio.Queue(), False, False
        self._readers[uid] = reader
        self._start_stepping()  # asleep until the admission below wakes it
        try:
            prepared = await asyncio.to_thread(self.api.prepare, [(uid, payload)])
            async with order:  # "accepted" is read before any step's message for it
                admitting = True
                self._dispatch(await self._on_engine_thread(self.api.admit, prepared))
            wake.set()
            while not last:
                message, last = await reader.get()
                yield message, last
        finally:
            self._readers.pop(uid, None)
            if admitting and not last:  # abandoned in the engine: the next step aborts it
                self.api.board.post(uid)
                wake.set()

    def _start_stepping(self) -> None:
        if self._steps is None or self._steps.done():
            self._steps = asyncio.ensure_future(self._step_loop())

    async def _step_loop(self) -> None:
        order, wake = self._loop_objects()
        while True:
            if not self.api.has_active_requests():  # a cancel matters only for a request in the engine
                wake.clear()
                await wake.wait()
                await _gather(wake)
                continue
            async with order:
                self._dispatch(await self._step())

    async def _step(self) -> list:
        try:
            events = await self._on_engine_thread(self.api.step)
            self.api.step_failed(False)
            return events
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            self.api.step_failed(True)
            return self.api.fail_all()

    def _dispatch(self, events: list) -> None:
        for uid, message, last in events:
            reader = self._readers.get(uid)
            if reader is not None:  # an aborted request's last event has no reader
                reader.put_nowait((message, last))

    async def _on_engine_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.api.engine_thread, fn, *args)

    async def check_health(self) -> None:
        """Raise if this replica cannot serve: its last steps failed and an empty step fails too."""
        if self.api.state.worker(0).failed_steps < UNHEALTHY_AFTER_FAILED_STEPS:
            return
        await self._on_engine_thread(self.api.probe)
        self.api.step_failed(False)

    def stats(self) -> dict:
        """The engine's counters as /stats shows them, and this replica's status."""
        status = self.api.state.worker(0)
        problem = status.problem()
        published = self.api.state.published(0)
        return dict(published, pid=os.getpid(), ready=int(problem is None), problem=problem)

    def metrics_text(self) -> str:
        """This replica's Prometheus series (counters, histograms and its gauges)."""
        return self.api.metrics.render(self.api.state).decode()


async def _gather(wake: asyncio.Event) -> None:
    """An idle engine takes a burst together: each admission sets `wake`, and the first step waits until
    none came for GATHER_S, so 8 chats sent at once are read in one wide step (as a LitServe worker's intake)."""
    while True:
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), GATHER_S)
        except asyncio.TimeoutError:
            return


def replica_error(e: BaseException) -> APIError:
    """A Ray error while reading a replica's stream, in the client's terms."""
    name = type(e).__name__
    if name in ("ActorDiedError", "ActorUnavailableError", "RayActorError", "ReplicaUnavailableError"):
        message = "the engine replica serving this request stopped; it is being replaced, retry"
        return APIError(503, message, code="worker_died")
    logger.error("engine replica call failed: %r", e)
    return APIError(500, "the inference worker failed; see the server log", code="worker_error")
