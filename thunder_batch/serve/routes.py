"""The HTTP side of `thunder-batch serve`: OpenAI routes as a LitServe spec, admission and errors.

Runs in LitServe's API server processes. Requests are parsed by `openai` and answers shaped by
`responses`; `calls.Call` moves them between HTTP and the inference workers. A request is admitted only
while the server is not draining (else 503) and, with `--max_waiting` set, while the requests in
flight over every HTTP process leave room for its choices (else 429 with Retry-After): nothing is
tokenized before that. Without it, requests wait (as in vLLM and llama-server) until the request timeout.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.specs.base import LitSpec
from starlette.exceptions import HTTPException

from thunder_batch.serve.in_flight import Call, ClientGone
from thunder_batch.serve.openai import CHAT, COMPLETION, APIError, Limits, ParsedRequest, parse_request
from thunder_batch.serve.responses import SSE_DONE, Choice, ResponseBuilder, models_list, sse, usage

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 1


@dataclass(frozen=True)
class ServeSettings:
    """What the HTTP side needs to know: the model's name, the workers' size and the server's limits.
    max_waiting: requests each worker may hold beyond its slots (None: no bound); request_timeout: seconds
    (None: off)."""

    model: str
    batch_size: int = 8
    max_waiting: int | None = None
    workers: int = 1
    max_body_bytes: int = 1_000_000
    request_timeout: float | None = None

    @property
    def capacity(self) -> int | None:
        """Choices in flight over the whole server: every worker's slots and waiting room (None: no bound)."""
        return None if self.max_waiting is None else self.workers * (self.batch_size + self.max_waiting)

    @property
    def limits(self) -> Limits:
        """One request's answers: at most a worker's slots and waiting room (slots twice without a bound)."""
        waiting = self.batch_size if self.max_waiting is None else self.max_waiting
        return Limits(max_n=self.batch_size, max_choices=self.batch_size + waiting)


class OpenAIRoutes(LitSpec):
    """LitServe spec with the OpenAI routes. A request goes to a worker through LitServe's request
    queue; the worker's messages come back through LitServe's response buffer. A request abandoned by
    its client is posted on the cancel board, which the workers read every step."""

    def __init__(self, settings: ServeSettings, state, board):
        super().__init__()
        self.api_path = "/v1/chat/completions"  # also names the request queue LitServe gives the worker
        self.settings, self.state, self.board = settings, state, board
        self.model, self.created, self._metrics = settings.model, int(time.time()), None
        self.add_endpoint("/v1/chat/completions", self.chat_completions, ["POST"])
        self.add_endpoint("/v1/completions", self.completions, ["POST"])
        self.add_endpoint("/v1/models", self.models, ["GET"])
        self.add_endpoint("/stats", self.stats, ["GET"])
        self.add_endpoint("/metrics", self.metrics_text, ["GET"])

    @property
    def stream(self) -> bool:
        return True  # every answer travels on LitServe's streaming path, token by token

    @property
    def http_index(self) -> int:
        return self.response_queue_id or 0  # LitServe numbers its HTTP processes 0, 1, ...

    @property
    def metrics(self):
        if self._metrics is None:  # made in this HTTP process, after the serve command set up metrics
            from thunder_batch.serve.metrics import Metrics

            self._metrics = Metrics(self.model)
        return self._metrics

    async def models(self) -> dict:
        return models_list(self.model, self.created)

    async def metrics_text(self) -> Response:
        from thunder_batch.serve.metrics import CONTENT_TYPE

        return Response(self.metrics.render(self.state), media_type=CONTENT_TYPE)

    async def stats(self) -> Response:
        """Every worker's engine counters (slots, queue, steps, tokens, compiles), summed, and each worker's own."""
        workers = [dict(self.state.published(w.index), **vars(w)) for w in self.state.all_workers()]
        in_flight, cancels = self.state.in_flight(), self.board.pending()
        return JSONResponse(dict(sum_stats(workers), in_flight=in_flight, cancels_pending=cancels, workers=workers))

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: Request, kind: str) -> Response:
        start = time.monotonic()
        try:
            job = parse_request(await read_body(request, self.settings.max_body_bytes), kind, self.settings.limits)
            self._admit(job)
            payload = dict(job.payload(), arrival=time.time(), request_id=request_id(request))
            call = self.call(payload, job, request)
            call.watch(request)
        except APIError as e:
            self.metrics.labels(self.metrics.request_rejected, status=str(e.status)).inc()
            return error_response(e)
        streaming = False
        try:
            accepted = await call.next()  # the worker's verdict: accepted, or a 4xx
            bodies = ResponseBuilder(kind, call.uid, self.model, job.logprobs, job.tool_names)
            if job.stream:
                streaming = True  # from here the response owns the call, and listens for the disconnect
                call.unwatch()
                body = self._stream(call, job, bodies, accepted["prompt_tokens"], start, request)
                return _ClosingStream(body, call.close)
            return await self._collect(call, job, bodies, accepted["prompt_tokens"], start, request)
        except APIError as e:
            self._failed(e, request, call)
            return error_response(e)
        except ClientGone:
            self._finished(["abort"] * job.choices)
            return Response(status_code=499)
        finally:
            if not streaming:
                call.close()

    def call(self, payload: dict, job: ParsedRequest, request: Request) -> Call:
        """Hand a request to the inference workers: on LitServe's queue (a Ray Serve ingress overrides this)."""
        return Call(self, payload, job.choices)

    def _admit(self, job: ParsedRequest) -> None:
        if self.state.draining:
            raise APIError(503, "the server is shutting down: send this request elsewhere", code="draining")
        capacity = self.settings.capacity
        if capacity is not None and self.state.in_flight() + job.choices > capacity:
            raise APIError(
                429,
                f"the server is at capacity: {capacity} requests in flight ({self.settings.workers} workers x "
                f"({self.settings.batch_size} slots + {self.settings.max_waiting} waiting)); retry later",
                code="server_overloaded",
            )

    async def _collect(
        self, call: Call, job: ParsedRequest, bodies: ResponseBuilder, prompt_tokens: int, start, request
    ) -> Response:
        choices = [Choice(i) for i in range(job.choices)]
        while not call.done:
            message = await call.next()
            choices[message["index"]].add(message)
        used = usage(prompt_tokens, sum(c.completion_tokens for c in choices))
        self._finished([c.finish_reason for c in choices], start)
        return JSONResponse(bodies.full(choices, used))

    async def _stream(
        self, call: Call, job: ParsedRequest, bodies: ResponseBuilder, prompt_tokens: int, start, request
    ):
        choices = [Choice(i) for i in range(job.choices)]
        try:
            if job.kind == CHAT:
                for choice in choices:
                    yield sse(bodies.chunk(choice, role=True))
            while not call.done:
                message = await call.next()
                choice = choices[message["index"]]
                choice.add(message)
                yield sse(bodies.chunk(choice, message))
            if job.include_usage:
                yield sse(bodies.usage_chunk(usage(prompt_tokens, sum(c.completion_tokens for c in choices))))
            yield SSE_DONE
            self._finished([c.finish_reason for c in choices], start)
        except APIError as e:  # the status line is long gone: an error event, then the end of the stream
            self._failed(e, request, call)
            yield sse(e.body())
            yield SSE_DONE

    def _finished(self, reasons: list, start: float | None = None) -> None:
        for reason in reasons:
            self.metrics.labels(self.metrics.request_success, finished_reason=reason or "abort").inc()
        if start is not None:
            self.metrics.labels(self.metrics.e2e).observe(time.monotonic() - start)

    def _failed(self, e: APIError, request: Request, call: Call) -> None:
        reason = "timeout" if e.status == 504 else ("error" if e.status >= 500 else None)
        if reason is None:  # the worker refused it (prompt too long, ...): a rejection, not a finish
            self.metrics.labels(self.metrics.request_rejected, status=str(e.status)).inc()
            return
        self._finished([reason] * call.choices)
        logger.warning("request %s (%s): %d %s: %s", request_id(request), call.uid, e.status, e.code, e.message)


def sum_stats(workers: list[dict]) -> dict:
    """Counters summed over workers (numbers added, dicts of numbers merged); the first worker's other fields."""
    total: dict = {}
    for stats in workers:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("index", "pid"):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                merged = total.setdefault(key, {})
                for k, v in value.items():
                    merged[k] = merged.get(k, 0) + v if isinstance(v, (int, float)) else v
            else:
                total.setdefault(key, value)
    total.pop("index", None), total.pop("pid", None)
    return total


class _ClosingStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends. A client that hangs up makes Starlette cancel
    the send, which can leave the body generator suspended (its `finally` would wait for the GC)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id", "-")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError 413 as soon as it passes `limit` bytes (never buffered whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="request_too_large"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's {"error": {...}} JSON, including FastAPI's own 404/405/422."""

    async def api_error(request, exc: APIError):
        return error_response(exc)

    async def http_error(request, exc: HTTPException):
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(APIError(exc.status_code, message))

    async def validation_error(request, exc: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {exc.errors()}"))

    async def unexpected(request, exc: Exception):
        return error_response(APIError(500, "internal server error; see the server log", code="internal_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
