"""One request in flight, seen from an HTTP process: submitted to LitServe's queue, read message by
message, cancelled if abandoned. It counts towards the server's in-flight requests from submission to
close, knows which worker took it (a 503 if that worker dies), and enforces the request timeout."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from contextlib import suppress

from fastapi import Request
from litserve.utils import LitAPIStatus, ResponseBufferItem

from thunder_batch.serve.openai import APIError

POLL_S = 1.0  # how often a waiting request checks its client, its worker and its deadline


class ClientGone(Exception):
    pass


class Call:
    def __init__(self, routes, payload: dict, choices: int = 1):
        """routes: the OpenAIRoutes of this HTTP process; choices: what it counts for in flight."""
        self.routes, self.uid, self.choices = routes, uuid.uuid4().hex, choices
        self.done, self.closed, self.owner = False, False, None  # owner: (worker index, pid) once claimed
        timeout = routes.settings.request_timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else None
        self.checked_at = self.started
        self.item = ResponseBufferItem(event=asyncio.Event(), response_queue=deque())
        routes.response_buffer[self.uid] = self.item
        routes.state.add_in_flight(routes.http_index, choices)
        try:
            routes.request_queue.put((routes.response_queue_id, self.uid, time.monotonic(), payload))
        except Exception:
            self.done = True
            self.close()
            raise APIError(503, "LitServe's request queue is unreachable; see /health", code="queue_lost") from None

    async def next(self, request: Request | None = None) -> dict:
        """The worker's next message; raises APIError for an error (504 past the deadline, 503 if the
        worker died), ClientGone if `request`'s client left (checked every POLL_S)."""
        queue, event = self.item.response_queue, self.item.event
        while True:
            await self._check(request)
            if queue:
                message, status = queue.popleft()
                if status == LitAPIStatus.ERROR:
                    self.done = True
                    raise APIError(500, "the inference worker failed; see the server log", code="worker_error")
                if message["event"] == "claimed":
                    self.owner = (message["worker"], message["pid"])
                    continue
                self.done = status == LitAPIStatus.FINISH_STREAMING
                if message["event"] == "error":
                    self.done = True
                    raise APIError(**message["error"])
                return message
            event.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), self._wait_s())

    def _wait_s(self) -> float:
        if self.deadline is None:
            return POLL_S
        return max(min(POLL_S, self.deadline - time.monotonic()), 0.001)

    async def _check(self, request: Request | None) -> None:
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            timeout = self.routes.settings.request_timeout
            raise APIError(504, f"the request ran past the server's request timeout ({timeout:g} s)", code="timeout")
        if now - self.checked_at < POLL_S:
            return
        self.checked_at = now
        if self.owner is not None and not self._owner_alive():
            self.done = True  # nothing left to cancel
            message = "the inference worker serving this request stopped; it is being restarted, retry"
            raise APIError(503, message, code="worker_died")
        if request is not None and await request.is_disconnected():
            raise ClientGone

    def _owner_alive(self) -> bool:
        index, pid = self.owner
        status = self.routes.state.worker(index)
        return status.pid == pid and status.alive

    def close(self) -> None:
        """Stop counting it; if the worker may still be working on it, post a cancel (frees its slot)."""
        if self.closed:
            return
        self.closed = True
        self.routes.state.add_in_flight(self.routes.http_index, -self.choices)
        self.routes.response_buffer.pop(self.uid, None)
        if not self.done:
            self.done = True
            self.routes.board.post(self.uid)
