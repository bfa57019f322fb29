"""The worker's loop: LitServe's continuous batching loop reshaped for Engine (see `worker`).

Two tasks on the worker's event loop, each handing blocking work to a thread:
- intake takes requests off LitServe's queue only while the engine has room (up to B waiting beside
  its B slots: the rest stay in LitServe's queue, for whichever worker frees a slot first; an idle
  engine takes a burst together, waiting up to GATHER_S for each next request), tells
  the HTTP side at once which worker took each one, tokenizes outside the engine lock, then admits;
- steps run back to back while requests are in flight. A failed step fails the requests in flight
  (500) and counts towards the worker's health; an unhealthy worker takes no new requests and probes
  itself with an empty step every PROBE_S until one succeeds.
With nothing to do, the worker sleeps: its step task on an event, its intake on the shared state's
arrivals semaphore (see TAKE_WAIT_S). An idle server costs its processes ~0.04 CPU-seconds per 10 s, 40% of
it uvicorn's own 10 Hz tick (benchmarks/idle_server.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import suppress

from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop
from litserve.utils import LitAPIStatus, LoopResponseType

from thunder_batch.serve.shared_state import HEARTBEAT_S, MESSAGES_UID

logger = logging.getLogger(__name__)
PROBE_S = 5.0  # an unhealthy, idle worker tries an empty step this often
# An idle worker's step task sleeps on an event that every admission sets; the timeout only paces a
# sick worker's probes.
IDLE_WAIT_S = PROBE_S
RETRY_S = 1.0  # intake retries this often after LitServe's queue failed it
# A blocking get on LitServe's queue runs in its manager process: a get still pending there when this
# worker stops or dies (SIGSTOP, SIGKILL, a deadlock) hands the next request to a process that never
# claims it, and that request waits for its timeout. So a worker never leaves a get pending: it makes
# non-blocking gets, and between them sleeps on the shared state's arrivals semaphore (released once per
# request put) for up to TAKE_WAIT_S. Idle, that is one get per TAKE_WAIT_S, not one per few ms; a worker
# that dies asleep takes nothing with it, and a request whose wake-up went to a dead worker is found by
# another at its next look.
TAKE_WAIT_S = 1.0
# An idle engine takes a burst of requests together: it waits this long for each next one, so 8 chats
# sent at once are read in one wide first step, not in several narrow ones while the rest queue.
GATHER_S = 0.01
FULL_WAIT_S = 0.05  # a worker without room looks again this often (or when a step ends)


class EngineLoop(ContinuousBatchingLoop):
    def __init__(self):
        super().__init__()
        self._wake: asyncio.Event | None = None
        self._stepped: asyncio.Event | None = None
        self._order: asyncio.Lock | None = None
        self._heart: asyncio.Task | None = None
        self._probed_at = 0.0

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._wake is None:  # created on the worker's own event loop
            self._wake, self._stepped, self._order = asyncio.Event(), asyncio.Event(), asyncio.Lock()
        return self._wake, self._stepped

    @property
    def order(self) -> asyncio.Lock:
        """Held from an admission or a step until its messages are sent: a request's "accepted" leaves
        before its first token (both are made under the engine lock, but sent after it is released)."""
        self._events()
        return self._order

    # -- intake -----------------------------------------------------------------------------------
    async def schedule_task(self, lit_api, lit_spec, request_queue, transport) -> None:
        while True:  # intake must outlive any one bad moment: without it nothing is ever admitted again
            try:
                await self._intake(lit_api, request_queue, transport)
                lit_api.state.set_worker(lit_api.index, queue_lost=0)
            except (EOFError, OSError) as e:  # LitServe's queue manager is gone: /health says so
                lit_api.state.set_worker(lit_api.index, queue_lost=1)
                logger.error("LitServe's request queue is unreachable (%s); retrying", e)
                await asyncio.sleep(RETRY_S)
            except Exception:
                logger.exception("request intake failed; retrying")
                await asyncio.sleep(RETRY_S)

    async def _intake(self, lit_api, request_queue, transport) -> None:
        wake, stepped = self._events()
        room = lit_api.room()
        if room <= 0:
            stepped.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stepped.wait(), FULL_WAIT_S)
            return
        gather_s = 0.0 if lit_api.has_active_requests() else GATHER_S
        arrivals = lit_api.state.wait_for_request
        items = await asyncio.to_thread(self._take_requests, request_queue, arrivals, room, gather_s)
        if not items:
            return
        claimed = {"event": "claimed", "worker": lit_api.index, "pid": os.getpid()}
        for queue_id, uid, _, _ in items:
            self.response_queue_ids[uid] = queue_id
        self._send(transport, [(uid, claimed, False) for _, uid, _, _ in items])
        prepared = await asyncio.to_thread(lit_api.prepare, [(uid, payload) for _, uid, _, payload in items])
        async with self.order:
            self._send(transport, await _on_engine_thread(lit_api, lit_api.admit, prepared))
        wake.set()

    def _take_requests(self, request_queue, arrivals, room: int, gather_s: float) -> list:
        """Wait up to TAKE_WAIT_S for one request, then take others while there is room: those already
        queued, and those arriving within gather_s of the last one. arrivals(timeout_s) sleeps until a
        request is announced (`SharedState.wait_for_request`)."""
        items, item = [], self._poll(request_queue, arrivals, TAKE_WAIT_S)
        while item is not None:
            if len(item) == 4 and item[1] is not None:  # not LitServe's shutdown sentinel
                items.append(item)
                room -= _choices(item[3])
            if room <= 0:
                break
            item = self._poll(request_queue, arrivals, gather_s)
        return items

    def _poll(self, request_queue, arrivals, wait_s: float):
        """The next request if one arrives within wait_s (0: only one already queued), else None. A
        wake-up that finds nothing (its request taken by another worker) sleeps again."""
        deadline = time.monotonic() + wait_s
        while (item := self.get_request(request_queue, block=False)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not arrivals(left):
                return None
        return item

    # -- steps ------------------------------------------------------------------------------------
    async def run(
        self, lit_api, device, worker_id, request_queue, transport, workers_setup_status, callback_runner
    ) -> None:
        wake, stepped = self._events()
        if self._heart is None:
            self._heart = asyncio.ensure_future(self._beat(lit_api))
        if not lit_api.has_active_requests():
            await self._probe_if_sick(lit_api)
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), IDLE_WAIT_S)
            wake.clear()
            return
        async with self.order:
            try:
                events = await _on_engine_thread(lit_api, lit_api.step)
                lit_api.step_failed(False)
            except Exception:
                logger.exception("engine step failed; failing the requests in flight")
                lit_api.step_failed(True)
                events = lit_api.fail_all()
            self._send(transport, events)
        stepped.set()

    async def _beat(self, lit_api) -> None:
        """The heartbeat: this event loop is alive (a stopped or deadlocked worker stops beating and is restarted)."""
        while True:
            lit_api.state.beat(lit_api.index)
            await asyncio.sleep(HEARTBEAT_S)

    async def _probe_if_sick(self, lit_api) -> None:
        status = lit_api.state.worker(lit_api.index)
        if not status.failed_steps or time.monotonic() - self._probed_at < PROBE_S:
            return
        self._probed_at = time.monotonic()
        try:
            await _on_engine_thread(lit_api, lit_api.probe)
            lit_api.step_failed(False)
            logger.info("worker %d: an empty step succeeded; healthy again", lit_api.index)
        except Exception:
            logger.exception("worker %d: an empty step failed too", lit_api.index)
            lit_api.step_failed(True)

    def _send(self, transport, events: list) -> None:
        """Each HTTP process gets this send's messages as one batch: [(uid, message, status), ...]."""
        batches: dict[int, list] = {}
        for uid, message, finished in events:
            queue_id = self.response_queue_ids.get(uid)
            if queue_id is None:
                continue
            status = LitAPIStatus.FINISH_STREAMING if finished else LitAPIStatus.OK
            batches.setdefault(queue_id, []).append((uid, message, status))
            if finished:
                del self.response_queue_ids[uid]
        for queue_id, batch in batches.items():
            self.put_response(transport, queue_id, MESSAGES_UID, batch, LitAPIStatus.OK, LoopResponseType.STREAMING)


async def _on_engine_thread(lit_api, fn, *args):
    """Engine calls run on the worker's one engine thread (see `EngineAPI._load_engine`)."""
    return await asyncio.get_running_loop().run_in_executor(lit_api.engine_thread, fn, *args)


def _choices(payload: dict) -> int:
    return len(payload.get("prompts", ())) * payload.get("n", 1) or 1
