"""One request in flight, seen from an HTTP process: submitted to LitServe's queue (`Call`; a Ray Serve
replica's stream in `ray_ingress.ReplicaCall`), read message by message, cancelled if abandoned. It counts
towards the server's in-flight requests from submission to close: when its answer is handed over, when it
fails, and as soon as its client's disconnect arrives (`watch`: the ASGI disconnect message itself, not a
poll, so a client that retries at once is not counted twice). It knows which worker took it (a 503 if that
worker dies) and enforces the request timeout."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from contextlib import suppress

from fastapi import Request
from litserve.utils import LitAPIStatus, ResponseBufferItem

from thunder_batch.serve.openai import APIError
from thunder_batch.serve.shared_state import MESSAGES_UID

POLL_S = 1.0  # how often a waiting request checks its worker and its deadline


class ClientGone(Exception):
    pass


class Messages:
    """Where LitServe puts a worker's batch of messages (uid MESSAGES_UID): each to its own request."""

    def __init__(self, buffer: dict) -> None:
        self.buffer = buffer

    def append(self, response: tuple) -> None:
        batch, _ = response
        for uid, message, status in batch:
            item = self.buffer.get(uid)
            if item is not None:  # a request that closed meanwhile has no reader
                item.response_queue.append((message, status))
                item.event.set()


class CallBase:
    """What a request in flight is, whoever carries it to an engine (LitServe's queue here, a Ray Serve
    replica in `ray_ingress`): counted in flight from submission to close, watched for its client's
    disconnect, and bounded by the request timeout. Subclasses post the request and read its messages."""

    def __init__(self, routes, choices: int = 1):
        """routes: the OpenAIRoutes of this HTTP process; choices: what it counts for in flight."""
        self.routes, self.uid, self.choices = routes, uuid.uuid4().hex, choices
        self.done, self.closed = False, False
        self.gone, self._watcher = False, None  # gone: its client disconnected
        timeout = routes.settings.request_timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else None
        routes.state.add_in_flight(routes.http_index, choices)

    def watch(self, request: Request) -> None:
        """Close this call as soon as `request`'s client disconnects. Only while nothing else reads the
        ASGI messages: a streaming response listens for the disconnect itself (`unwatch` first)."""
        self._watcher = asyncio.ensure_future(self._watch(request))

    async def _watch(self, request: Request) -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the channel itself failed (Ray's proxy cancels it when the client leaves): gone too
            pass
        self.gone = True
        self.close()
        self._wake()

    def unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    def _wait_s(self) -> float:
        if self.deadline is None:
            return POLL_S
        return max(min(POLL_S, self.deadline - time.monotonic()), 0.001)

    def check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            timeout = self.routes.settings.request_timeout
            raise APIError(504, f"the request ran past the server's request timeout ({timeout:g} s)", code="timeout")

    def close(self) -> None:
        """Stop counting it; if the engine may still be working on it, cancel it (frees its slot)."""
        if self.closed:
            return
        self.closed = True
        if self._watcher is not None and not self.gone:
            self.unwatch()
        self.routes.state.add_in_flight(self.routes.http_index, -self.choices)
        self._closed()
        if not self.done:
            self.done = True
            self._cancel()

    def _wake(self) -> None:
        """Wake a reader waiting in `next` (its client left)."""

    def _closed(self) -> None:
        """What a subclass lets go of when the call closes."""

    def _cancel(self) -> None:
        raise NotImplementedError


class Call(CallBase):
    """A request carried by LitServe's request queue to whichever worker takes it first."""

    def __init__(self, routes, payload: dict, choices: int = 1):
        super().__init__(routes, choices)
        self.owner = None  # (worker index, pid) once claimed
        self.checked_at = self.started
        self.item = ResponseBufferItem(event=asyncio.Event(), response_queue=deque())
        if MESSAGES_UID not in routes.response_buffer:  # before the first message for this process can come
            routes.response_buffer[MESSAGES_UID] = ResponseBufferItem(asyncio.Event(), Messages(routes.response_buffer))
        routes.response_buffer[self.uid] = self.item
        try:
            routes.request_queue.put((routes.response_queue_id, self.uid, time.monotonic(), payload))
            routes.state.announce_request()  # after the put: the woken worker finds it there
        except Exception:
            self.done = True
            self.close()
            raise APIError(503, "LitServe's request queue is unreachable; see /health", code="queue_lost") from None

    async def next(self) -> dict:
        """The worker's next message; raises APIError for an error (504 past the deadline, 503 if the
        worker died), ClientGone if the client left (see `watch`)."""
        queue, event = self.item.response_queue, self.item.event
        while True:
            if self.gone:
                raise ClientGone
            self._check()
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

    def _check(self) -> None:
        self.check_deadline()
        now = time.monotonic()
        if now - self.checked_at < POLL_S:
            return
        self.checked_at = now
        if self.owner is not None and not self._owner_alive():
            self.done = True  # nothing left to cancel
            message = "the inference worker serving this request stopped; it is being restarted, retry"
            raise APIError(503, message, code="worker_died")

    def _owner_alive(self) -> bool:
        index, pid = self.owner
        status = self.routes.state.worker(index)
        return status.pid == pid and status.alive

    def _wake(self) -> None:
        self.item.event.set()

    def _closed(self) -> None:
        self.routes.response_buffer.pop(self.uid, None)

    def _cancel(self) -> None:
        self.routes.board.post(self.uid)
