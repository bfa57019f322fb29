"""The HTTP side of `thunder-batch serve --replicas N`: the same OpenAI routes, over Ray Serve replicas.

`ReplicaRoutes` is `OpenAIRoutes` (parsing, admission, limits, errors, streams: all unchanged) whose
`call` hands a request to the engine deployment's handle instead of LitServe's queue; the handle's
request router (`prefix_router.PrefixRouter`) picks the replica from the request's `RouteKey`. A
`ReplicaCall` reads the replica's stream: a replica that dies mid-request ends it with 503 `worker_died`
(an error event in a stream), a client that leaves cancels the stream (Ray cancels the replica's
generator, which frees the slot). /health, /stats and /metrics ask every replica (fan-out calls, one per
replica, routed by index): "ok" once every replica of N serves, "degraded: k of N" while Ray replaces one.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from thunder_batch.serve.auth import APIKeyMiddleware
from thunder_batch.serve.in_flight import CallBase, ClientGone
from thunder_batch.serve.openai import APIError, ParsedRequest
from thunder_batch.serve.prefix_router import RouteKey, prompt_text
from thunder_batch.serve.replicas import replica_error
from thunder_batch.serve.routes import OpenAIRoutes, ServeSettings, install_error_handlers, sum_stats
from thunder_batch.serve.shared_state import SharedState

logger = logging.getLogger(__name__)
FAN_OUT_TIMEOUT_S = 5.0  # a replica that does not answer /stats or /metrics by then counts as not serving
SESSION_HEADER = "x-session-id"


class ReplicaCall(CallBase):
    """A request carried to one engine replica by the deployment handle's router, read as a stream."""

    def __init__(self, routes: ReplicaRoutes, payload: dict, choices: int, route: RouteKey):
        super().__init__(routes, choices)
        self.stream = routes.handle.options(stream=True).generate.remote(payload, route=route)
        self._next: asyncio.Future | None = None  # the stream's pending __anext__, kept across waits

    async def next(self) -> dict:
        """The replica's next message; APIError for an error (504 past the deadline, 503 if the replica
        died), ClientGone if the client left (closing the call cancels the stream, which wakes the wait)."""
        while True:
            if self.gone:
                raise ClientGone
            self.check_deadline()
            if self._next is None:
                self._next = asyncio.ensure_future(self.stream.__anext__())
                self._next.add_done_callback(_retrieve)
            await asyncio.wait({self._next}, timeout=self._wait_s())
            if self._next.done() and not self.gone:
                return self._take(self._next)

    def _take(self, done: asyncio.Future) -> dict:
        self._next = None
        try:
            message, last = done.result()
        except StopAsyncIteration:
            self.done = True
            raise APIError(500, "the engine replica ended the stream early", code="worker_error") from None
        except Exception as e:
            self.done = True  # nothing left to cancel
            raise replica_error(e) from None
        self.done = last
        if message["event"] == "error":
            self.done = True
            raise APIError(**message["error"])
        return message

    def _cancel(self) -> None:
        self.stream.cancel()
        if self._next is not None:
            self._next.cancel()


class ReplicaRoutes(OpenAIRoutes):
    """OpenAIRoutes over a Ray Serve deployment handle of N engine replicas."""

    def __init__(self, settings: ServeSettings, handle, replicas: int):
        super().__init__(settings, SharedState(0, 1), None)
        self.handle, self.replicas = handle, replicas
        self.response_queue_id = 0

    def call(self, payload: dict, job: ParsedRequest, request: Request) -> ReplicaCall:
        """A session (the x-session-id header, else OpenAI's `user`) pins a conversation to one replica."""
        route = RouteKey(prompt_text(job.prompts), request.headers.get(SESSION_HEADER) or job.user)
        return ReplicaCall(self, payload, job.choices, route)

    async def fan_out(self, method: str) -> list:
        """Every serving replica's answer to `method` (each replica once, however many answer). One call at
        a time: calls made while serving one HTTP request share its internal request id, and Ray's router
        hands a chosen replica to the pending call with that id, so concurrent ones could wait forever."""
        by_replica = {}
        for k in range(self.replicas):
            try:
                call = getattr(self.handle, method).remote(route=RouteKey(replica=k))
                answer = await asyncio.wait_for(_result(call), FAN_OUT_TIMEOUT_S)
            except Exception as e:
                logger.warning("replica %d of %d did not answer %s: %r", k, self.replicas, method, e)
                continue
            by_replica.setdefault(answer["replica"], answer)
        return [by_replica[k] for k in sorted(by_replica)]

    async def stats(self) -> Response:
        """Every replica's engine counters, summed, and each replica's own."""
        replicas = await self.fan_out("stats")
        in_flight = self.state.in_flight()
        return JSONResponse(dict(sum_stats(replicas), in_flight=in_flight, replicas=replicas))

    async def metrics_text(self) -> Response:
        """The ingress's own series, then every replica's under a `replica` label."""
        from thunder_batch.serve.metrics import CONTENT_TYPE, merge_replicas

        texts = {a["replica"]: a["text"] for a in await self.fan_out("metrics_text")}
        return Response(merge_replicas(self.metrics.render().decode(), texts), media_type=CONTENT_TYPE)

    async def health(self) -> Response:
        """ "ok" when every replica serves; 200 "degraded: k of N" while one is replaced; 503 otherwise."""
        serving = [r for r in await self.fan_out("stats") if r["ready"]]
        if self.state.draining:
            status, code = "draining: the server is shutting down", 503
        elif len(serving) == self.replicas:
            return PlainTextResponse("ok")
        else:
            status, code = f"degraded: {len(serving)} of {self.replicas} replicas serve", 200 if serving else 503
            status = status if serving else f"starting: 0 of {self.replicas} replicas serve"
        return JSONResponse({"status": status, "replicas": serving}, status_code=code)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a stream read's error as seen: one read by a call that closed meanwhile is nobody's to raise."""
    if not future.cancelled():
        future.exception()


async def _result(response):
    return await response


def build_ingress_app(routes: ReplicaRoutes, api_key: str | None) -> FastAPI:
    """The ASGI app of the ingress: the routes, /health, API keys, OpenAI-shaped errors."""
    app = FastAPI()
    for path, endpoint, methods in routes.endpoints:
        app.add_api_route(path, endpoint, methods=methods)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_middleware(APIKeyMiddleware, key=api_key)
    install_error_handlers(app)
    return app
