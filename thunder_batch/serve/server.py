"""The main process of `thunder-batch serve`: assemble the LitServer, run it, drain, and stop every child.

LitServe starts the HTTP processes (`routes`) and the inference workers (`worker`) from here, and
restarts a worker that dies (`restart_workers`). The shared state and the cancel board are made here,
before any child starts. /health replaces LitServe's own: 503 while any worker is starting,
restarting or failing its steps, while LitServe's queue manager is gone, and while draining.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import litserve as ls
from fastapi.responses import JSONResponse, PlainTextResponse

from thunder_batch.serve.auth import APIKeyMiddleware
from thunder_batch.serve.cancels import CancelBoard
from thunder_batch.serve.routes import OpenAIRoutes, ServeSettings, install_error_handlers
from thunder_batch.serve.state import SharedState
from thunder_batch.serve.worker import EngineAPI

logger = logging.getLogger(__name__)
UVICORN_GRACE_S = 5  # the HTTP processes' own wait for open connections, after the drain
DRAIN_GRACE_S = 0.2


def build_server(
    options,
    *,
    api_key: str | None = None,
    accelerator: str = "auto",
    devices: int | str = "auto",
    workers_per_device: int = 1,
    max_body_bytes: int = 1_000_000,
    max_waiting: int | None = None,
    request_timeout: float | None = None,
) -> tuple[ls.LitServer, SharedState]:
    """A LitServer with the OpenAI routes over one EngineAPI, and the state its processes share.
    `options`: EngineOptions with a resolved checkpoint_dir; max_waiting: requests each worker may
    hold beyond its slots (None: no bound, they wait up to the request timeout)."""
    batch_size = options.engine_config().batch_size
    model = Path(options.checkpoint_dir).name
    routes = OpenAIRoutes(ServeSettings(model), None, None)
    api = EngineAPI(options, routes, None, None, model)
    server = ls.LitServer(
        api,
        accelerator=accelerator,
        devices=devices,
        workers_per_device=workers_per_device,
        timeout=False,
        restart_workers=True,
    )
    workers = len(server.devices) * workers_per_device  # LitServe starts one HTTP process per worker
    state, board = SharedState(workers, workers), CancelBoard()
    routes.settings = ServeSettings(model, batch_size, max_waiting, workers, max_body_bytes, request_timeout)
    routes.state = api.state = state
    routes.board = api.board = board
    server.uvicorn_graceful_timeout = UVICORN_GRACE_S
    server.app.add_middleware(APIKeyMiddleware, key=api_key)
    install_error_handlers(server.app)
    install_health(server, state)
    return server, state


def install_health(server: ls.LitServer, state: SharedState) -> None:
    server.app.router.routes = [r for r in server.app.router.routes if getattr(r, "path", None) != "/health"]

    async def health():
        problems = health_problems(state, getattr(server, "workers_setup_status", None))
        if not problems:
            return PlainTextResponse("ok")
        workers = [dict(vars(w), alive=w.alive) for w in state.all_workers()]
        return JSONResponse({"status": "unavailable", "problems": problems, "workers": workers}, status_code=503)

    server.app.add_api_route("/health", health, methods=["GET"])


def health_problems(state: SharedState, setup_status=None) -> list[str]:
    """Why the server cannot take requests now ([] when it can)."""
    problems = ["draining: the server is shutting down"] if state.draining else []
    if setup_status is not None:
        try:
            dict(setup_status)  # a round trip to LitServe's manager process
        except Exception:
            problems.append("LitServe's queue manager process is gone")
    return problems + [p for p in (w.problem() for w in state.all_workers()) if p]


def run_server(
    server: ls.LitServer,
    host: str,
    port: int,
    log_level: str = "info",
    state: SharedState | None = None,
    drain_timeout: float = 30.0,
) -> None:
    """server.run until Ctrl+C or SIGTERM; either way every child process is stopped before returning.
    SIGTERM drains first: new requests get 503 while those in flight finish (at most `drain_timeout`
    seconds); a second SIGTERM stops at once."""
    main_pid, main_thread = os.getpid(), threading.main_thread().ident

    def drain() -> None:
        deadline = time.monotonic() + drain_timeout
        time.sleep(DRAIN_GRACE_S)  # a request admitted as draining began is counted by now
        while state.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if state.in_flight():
            logger.warning("drain timeout (%gs): stopping with %d requests in flight", drain_timeout, state.in_flight())
        try:  # LitServe's own shutdown (its worker monitor stops restarting workers), then ours
            server._shutdown_event.set()
        except Exception:
            signal.pthread_kill(main_thread, signal.SIGINT)  # its manager is gone: the Ctrl+C path

    def on_sigterm(signum, frame):
        if os.getpid() != main_pid:
            raise SystemExit(0)  # a forked HTTP process re-raising SIGTERM after its own clean stop
        if state is None or state.draining:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one shutdown at a time
            raise KeyboardInterrupt
        logger.warning("SIGTERM: draining (new requests get 503), at most %gs", drain_timeout)
        state.start_draining()
        threading.Thread(target=drain, name="drain", daemon=True).start()

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
