"""The HTTP side of `thunder-batch serve`: OpenAI routes as a LitServe spec, errors and API keys.

Runs in LitServe's API server processes. Requests are parsed and answers shaped by
`openai`; this module moves them between HTTP and the inference worker (`worker.EngineAPI`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from contextlib import suppress

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.specs.base import LitSpec
from litserve.utils import LitAPIStatus, ResponseBufferItem
from starlette.exceptions import HTTPException

from thunder_batch.serve.openai import (
    CHAT,
    COMPLETION,
    SSE_DONE,
    APIError,
    Job,
    Shaper,
    models_list,
    parse_request,
    sse,
    usage,
)

DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    pass


class OpenAIRoutes(LitSpec):
    """LitServe spec with the OpenAI routes. A request goes to the worker through LitServe's request
    queue; the worker's messages come back through LitServe's response buffer. A request abandoned by
    its client is posted on `cancel_board` (uid -> time), which the worker reads every step."""

    def __init__(self, model: str, cancel_board, max_body_bytes: int):
        super().__init__()
        self.api_path = "/v1/chat/completions"  # also names the request queue LitServe gives the worker
        self.model, self.cancel_board, self.max_body_bytes = model, cancel_board, max_body_bytes
        self.created = int(time.time())
        self.add_endpoint("/v1/chat/completions", self.chat_completions, ["POST"])
        self.add_endpoint("/v1/completions", self.completions, ["POST"])
        self.add_endpoint("/v1/models", self.models, ["GET"])
        self.add_endpoint("/stats", self.stats, ["GET"])

    @property
    def stream(self) -> bool:
        return True  # every answer travels on LitServe's streaming path, token by token

    async def models(self) -> dict:
        return models_list(self.model, self.created)

    async def stats(self) -> Response:
        """The engine counters of whichever worker picks this up (slots in use, queue, steps, compiles)."""
        call = _Call(self, {"stats": True})
        try:
            return JSONResponse((await call.next())["stats"])
        except APIError as e:
            return error_response(e)
        finally:
            call.close()

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            job = parse_request(await read_body(request, self.max_body_bytes), kind)
        except APIError as e:
            return error_response(e)
        call, streaming = _Call(self, job.payload()), False
        try:
            accepted = await call.next(request)  # the worker's verdict: accepted, or a 4xx
            shaper = Shaper(kind, call.uid, self.model)
            if job.stream:
                streaming = True  # from here the response owns the call
                return _ClosingStream(self._stream(call, job, shaper, accepted["prompt_tokens"]), call.close)
            return await self._collect(call, shaper, accepted["prompt_tokens"], request)
        except APIError as e:
            return error_response(e)
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                call.close()

    async def _collect(self, call: _Call, shaper: Shaper, prompt_tokens: int, request: Request) -> Response:
        parts = []
        while not call.done:
            message = await call.next(request)
            parts.append(message["text"])
        body = shaper.full("".join(parts), message["finish_reason"], usage(prompt_tokens, message["completion_tokens"]))
        return JSONResponse(body)

    async def _stream(self, call: _Call, job: Job, shaper: Shaper, prompt_tokens: int):
        try:
            if job.kind == CHAT:
                yield sse(shaper.chunk(role=True))
            while not call.done:
                message = await call.next()
                if message["text"]:
                    yield sse(shaper.chunk(message["text"]))
            yield sse(shaper.chunk(finish_reason=message["finish_reason"]))
            if job.include_usage:
                yield sse(shaper.usage_chunk(usage(prompt_tokens, message["completion_tokens"])))
            yield SSE_DONE
        except APIError as e:
            yield sse(e.body())


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


class _Call:
    """One request in flight: submitted to the worker, read message by message, cancelled if abandoned."""

    def __init__(self, routes: OpenAIRoutes, payload: dict):
        self.routes, self.uid, self.done, self.checked_at = routes, uuid.uuid4().hex, False, time.monotonic()
        self.item = ResponseBufferItem(event=asyncio.Event(), response_queue=deque())
        routes.response_buffer[self.uid] = self.item
        routes.request_queue.put((routes.response_queue_id, self.uid, time.monotonic(), payload))

    async def next(self, request: Request | None = None) -> dict:
        """The worker's next message; raises APIError for an error, ClientGone if `request`'s client left
        (checked every DISCONNECT_POLL_S, whether or not tokens are flowing)."""
        queue, event = self.item.response_queue, self.item.event
        while True:
            if request is not None and time.monotonic() - self.checked_at >= DISCONNECT_POLL_S:
                self.checked_at = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone
            if queue:
                break
            event.clear()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), DISCONNECT_POLL_S if request is not None else None)
        message, status = queue.popleft()
        self.done = status in (LitAPIStatus.FINISH_STREAMING, LitAPIStatus.ERROR)
        if status == LitAPIStatus.ERROR:
            raise APIError(500, "the inference worker failed; see the server log", code="worker_error")
        if message["event"] == "error":
            raise APIError(**message["error"])
        return message

    def close(self) -> None:
        self.routes.response_buffer.pop(self.uid, None)
        if not self.done:  # the client left before the end: the worker aborts it and frees its slot
            self.done = True
            self.routes.cancel_board[self.uid] = time.time()


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
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
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
