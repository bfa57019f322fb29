"""The inference worker of `thunder-batch serve`: one Engine per worker process, continuous batching.

LitServe runs three kinds of process: the main process (`server`), which starts the others and waits;
an HTTP process per worker (`routes`); and the inference workers (devices x workers_per_device), each
owning one Engine built in `EngineAPI.setup`. Inside a worker, `EngineLoop` runs two threads that
both touch the engine, so it sits behind a lock:
- intake: takes requests off LitServe's queue and admits them (between steps, in batches);
- steps: `Engine.step()` back to back while any request is unfinished.
With nothing to do, the worker sleeps on an event: an idle server does not spin a core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from contextlib import suppress

import litserve as ls
from fastapi import Request
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop
from litserve.utils import LitAPIStatus, LoopResponseType

from thunder_batch.config import ContextLengthError, is_chat
from thunder_batch.serve.auth import check_api_key
from thunder_batch.serve.openai import APIError

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 1.0  # an idle worker looks at its queue this often; a new request wakes it at once
CANCEL_TTL_S = 60.0  # a cancel no worker claims (its request had already finished) is dropped after this

Event = tuple  # (uid, message dict for the HTTP side, finished: bool)


class EngineAPI(ls.LitAPI):
    """The Engine behind LitServe. Messages to the HTTP side (see `routes._Call`):
    {"event": "accepted", "prompt_tokens"}, {"event": "delta", "text"[, "finish_reason", "completion_tokens"]},
    {"event": "error", "error": APIError fields}."""

    def __init__(self, options, spec, cancel_board, api_key: str | None = None):
        """options: the command's EngineOptions (each worker builds its own Engine from them in `setup`);
        spec: the HTTP side's LitSpec (`routes.OpenAIRoutes`); cancel_board: the dict it posts abandoned
        uids on (uid -> time)."""
        super().__init__(spec=spec, loop=EngineLoop())
        self.options, self.cancel_board, self.api_key = options, cancel_board, api_key
        self.engine, self.lock, self._requests = None, None, {}

    def setup(self, device) -> None:
        engine = self.options.load_engine(device)
        if engine.config.compile == "thunder":
            engine.warmup(progress=True)  # make every step shape now, not on the first request
        self.attach(engine)

    def attach(self, engine) -> None:
        self.engine, self.lock = engine, threading.Lock()
        self._requests: dict = {}  # uid -> its Request, for each request in the engine

    def authorize(self, request: Request) -> None:
        check_api_key(request, self.api_key)  # LitServe runs this as a dependency of every route

    def has_active_requests(self) -> bool:
        return bool(self._requests)

    def add_requests(self, items: list[tuple[str, dict]]) -> list[Event]:
        """Admit (uid, payload) pairs in one go: each is accepted, or rejected with a 4xx message."""
        with self.lock:
            return [self._admit(uid, payload) for uid, payload in items]

    def _admit(self, uid: str, payload: dict) -> Event:
        if payload.get("stats"):
            return uid, {"event": "stats", "stats": self._stats()}, True
        prompt = payload["prompt"]
        try:  # the engine encodes the prompt once; a max_new_tokens of None becomes the rest of the cache
            request = self.engine.submit(prompt, payload["params"], request_id=uid)
        except ContextLengthError as e:
            return uid, {"event": "error", "error": _context_error(e, prompt).to_dict()}, True
        except ValueError as e:  # the engine's own checks: roles, token ids, chat template
            error = APIError(400, str(e), _prompt_param(prompt), "invalid_value")
            return uid, {"event": "error", "error": error.to_dict()}, True
        except Exception:  # a bug, not the client's fault: fail this request, keep serving the others
            logger.exception("could not admit request %s", uid)
            return uid, {"event": "error", "error": APIError(500, "could not admit the request").to_dict()}, True
        self._requests[uid] = request
        return uid, {"event": "accepted", "prompt_tokens": len(request.prompt_ids)}, False

    def _stats(self) -> dict:
        stats = self.engine.stats()
        batch_size = self.engine.config.batch_size
        return json.loads(
            json.dumps(
                dict(
                    stats,
                    batch_size=batch_size,
                    free_slots=batch_size - stats["running"],
                    in_flight=len(self._requests),
                ),
                default=str,
            )
        )

    def step(self) -> list[Event]:
        """Abort what clients abandoned, run one engine step, and report what it released."""
        board = dict(self.cancel_board.items())  # one round trip to the manager, outside the lock
        with self.lock:
            mine = [uid for uid in board if uid in self._requests]
            for uid in mine:
                self.engine.abort(uid)  # its slot is free for this very step
                del self._requests[uid]
            events = [(uid, {"event": "aborted"}, True) for uid in mine]  # nobody reads it: it closes the uid
            outputs = self.engine.step() if self._requests else []
            events += [e for e in map(self._event, outputs) if e is not None]
        now = time.time()
        for uid in mine + [u for u, t in board.items() if now - t > CANCEL_TTL_S and u not in mine]:
            self.cancel_board.pop(uid, None)
        return events

    def _event(self, output) -> Event | None:
        uid = output.request_id
        if not output.finished:
            return (uid, {"event": "delta", "text": output.text}, False) if output.text else None
        request = self._requests.pop(uid)  # finished: every token it kept has been released
        message = {
            "event": "delta",
            "text": output.text or "",
            "finish_reason": output.finish_reason,
            "completion_tokens": len(request.output_ids),
        }
        return uid, message, True

    def fail_all(self) -> list[Event]:
        """After a failed step: abort every request and tell each client (500)."""
        with self.lock:
            uids = list(self._requests)
            for uid in uids:
                self.engine.abort(uid)
            self._requests.clear()
        error = APIError(500, "the engine failed during a step; see the server log", code="engine_error").to_dict()
        return [(uid, {"event": "error", "error": error}, True) for uid in uids]


def _prompt_param(prompt) -> str:
    return "messages" if is_chat(prompt) else "prompt"


def _context_error(e: ContextLengthError, prompt) -> APIError:
    """In the client's terms: max_tokens when the prompt alone fits, else the prompt is too long."""
    n, limit, wanted = e.prompt_tokens, e.max_seq_length, e.max_new_tokens
    param = "max_tokens" if n < limit else _prompt_param(prompt)
    return APIError(
        400,
        f"this server's context length is {limit} tokens (max_seq_length): the prompt has {n} "
        f"tokens and max_tokens asks for {wanted or 'at least 1'} more",
        param,
        "context_length_exceeded",
    )


class EngineLoop(ContinuousBatchingLoop):
    """LitServe's continuous batching loop, reshaped for Engine: requests are admitted in batches as they
    arrive (the engine queues what does not fit in B slots), a step runs only when there is work, and an
    idle worker waits on an event instead of spinning."""

    def __init__(self):
        super().__init__()
        self._wake: asyncio.Event | None = None

    def _wake_event(self) -> asyncio.Event:
        if self._wake is None:  # created on the worker's own event loop
            self._wake = asyncio.Event()
        return self._wake

    async def schedule_task(self, lit_api: EngineAPI, lit_spec, request_queue, transport) -> None:
        while True:  # intake must outlive any one bad moment: without it nothing is ever admitted again
            try:
                await self._intake(lit_api, request_queue, transport)
            except Exception:
                logger.exception("request intake failed; retrying")
                await asyncio.sleep(IDLE_WAIT_S)

    async def _intake(self, lit_api: EngineAPI, request_queue, transport) -> None:
        items = await asyncio.to_thread(self._take_requests, request_queue)
        if not items:
            return
        for queue_id, uid, _, _ in items:
            self.response_queue_ids[uid] = queue_id
        events = await asyncio.to_thread(lit_api.add_requests, [(uid, payload) for _, uid, _, payload in items])
        self._send(transport, events)
        self._wake_event().set()

    def _take_requests(self, request_queue) -> list:
        """Block up to IDLE_WAIT_S for one request, then take all others already queued."""
        items, item = [], self.get_request(request_queue, timeout=IDLE_WAIT_S)
        while item is not None:
            if len(item) == 4 and item[1] is not None:  # not LitServe's shutdown sentinel
                items.append(item)
            item = self.get_request(request_queue, block=False)
        return items

    async def run(
        self, lit_api: EngineAPI, device, worker_id, request_queue, transport, workers_setup_status, callback_runner
    ) -> None:
        if not lit_api.has_active_requests():
            wake = self._wake_event()
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wake.wait(), IDLE_WAIT_S)
            wake.clear()
            return
        try:
            events = await asyncio.to_thread(lit_api.step)
        except Exception:
            logger.exception("engine step failed; failing the requests in flight")
            events = lit_api.fail_all()
        self._send(transport, events)

    def _send(self, transport, events: list[Event]) -> None:
        for uid, message, finished in events:
            queue_id = self.response_queue_ids.get(uid)
            if queue_id is None:
                continue
            status = LitAPIStatus.FINISH_STREAMING if finished else LitAPIStatus.OK
            self.put_response(transport, queue_id, uid, message, status, LoopResponseType.STREAMING)
            if finished:
                del self.response_queue_ids[uid]
