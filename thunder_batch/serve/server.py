"""The main process of `thunder-batch serve`: assemble the LitServer, run it, drain, and stop every child.

LitServe starts the HTTP processes (`routes`) and the inference workers (`worker`) from here, and
restarts a worker that dies (`restart_workers`); a worker whose heartbeat stops (`--worker_timeout`) is
killed here, so LitServe restarts it too. The shared state and the cancel board are made here, before
any child starts. /health replaces LitServe's own: 200 "ok" when every worker serves, 200 with the
degraded workers listed while at least one serves, 503 when none does, while LitServe's queue manager
is gone, and while draining. SIGTERM drains in the main process; every child ignores it until the drain
is over (so SIGTERM to the whole process group drains too).
"""

from __future__ import annotations

import contextlib
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
from thunder_batch.serve.shared_state import HEARTBEAT_S, SharedState
from thunder_batch.serve.worker import EngineAPI

logger = logging.getLogger(__name__)
UVICORN_GRACE_S = 5  # the HTTP processes' own wait for open connections, after the drain
DRAIN_GRACE_S = 0.2
LITSERVE_HOSTS = ("0.0.0.0", "127.0.0.1", "::")
WORKER_TIMEOUT_S = 30.0  # heartbeat silence after which a ready worker is killed and restarted


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
    worker_timeout: float = WORKER_TIMEOUT_S,
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
    state, board = SharedState(workers, workers, worker_timeout), CancelBoard()
    routes.settings = ServeSettings(model, batch_size, max_waiting, workers, max_body_bytes, request_timeout)
    routes.state = api.state = state
    routes.board = api.board = board
    server.uvicorn_graceful_timeout = UVICORN_GRACE_S
    server.app.add_middleware(APIKeyMiddleware, key=api_key)
    install_error_handlers(server.app)
    server.app.add_middleware(SigtermAfterDrain, state=state)
    install_health(server, state)
    return server, state


def install_health(server: ls.LitServer, state: SharedState) -> None:
    server.app.router.routes = [r for r in server.app.router.routes if getattr(r, "path", None) != "/health"]

    async def health():
        status, problems = health_status(state, getattr(server, "workers_setup_status", None))
        if status == "ok":
            return PlainTextResponse("ok")
        workers = [dict(vars(w), alive=w.alive) for w in state.all_workers()]
        body = {"status": status, "problems": problems, "workers": workers}
        return JSONResponse(body, status_code=200 if status == "degraded" else 503)

    server.app.add_api_route("/health", health, methods=["GET"])


def health_status(state: SharedState, setup_status=None) -> tuple[str, list[str]]:
    """("ok", []), ("degraded", problems) while at least one worker serves, else ("unavailable", problems)."""
    problems = health_problems(state, setup_status)
    serving = [w for w in state.all_workers() if w.problem(state.worker_timeout) is None]
    whole = state.draining or any("queue manager" in p for p in problems)
    return ("ok" if not problems else "unavailable" if whole or not serving else "degraded"), problems


def health_problems(state: SharedState, setup_status=None) -> list[str]:
    """Why the server, or one of its workers, cannot take requests now ([] when all can)."""
    problems = ["draining: the server is shutting down"] if state.draining else []
    if setup_status is not None:
        try:
            dict(setup_status)  # a round trip to LitServe's manager process
        except Exception:
            problems.append("LitServe's queue manager process is gone")
    return problems + [p for p in (w.problem(state.worker_timeout) for w in state.all_workers()) if p]


def watch_heartbeats(state: SharedState, stop: threading.Event) -> None:
    """Kill a ready worker whose event loop has not beaten for state.worker_timeout seconds (stopped,
    deadlocked): LitServe restarts it, and the HTTP side answers its requests 503 (worker_died)."""
    while state.worker_timeout and not stop.wait(HEARTBEAT_S):
        for w in state.all_workers():
            if w.alive and w.silent_s() > state.worker_timeout:
                logger.error("worker %d (pid %d): no heartbeat for %.0f s; killing it", w.index, w.pid, w.silent_s())
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)
                state.set_worker(w.index, ready=0)


class SigtermAfterDrain:
    """ASGI middleware that, in each HTTP process, holds uvicorn's SIGTERM handler back until the main
    process has drained (state.stopping): SIGTERM to the whole process group then drains too, instead of
    uvicorn closing its connections. Installed when the process's lifespan starts (uvicorn's handler is set)."""

    def __init__(self, app, state: SharedState) -> None:
        self.app, self.state, self.installed = app, state, False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan" and not self.installed:
            self.installed = True
            with contextlib.suppress(ValueError):  # not the main thread: nothing to hold back
                signal.signal(signal.SIGTERM, after_drain(self.state, signal.getsignal(signal.SIGTERM)))
        await self.app(scope, receive, send)


def after_drain(state: SharedState, handler):
    """A SIGTERM handler for a child process: `handler` once the main process is stopping, else nothing."""

    def on_sigterm(signum, frame):
        if state.stopping and callable(handler):
            handler(signum, frame)
        elif state.stopping:
            raise SystemExit(0)

    return on_sigterm


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
        state.start_stopping()  # the children take SIGTERM from now on
        try:  # LitServe's own shutdown (its worker monitor stops restarting workers), then ours
            server._shutdown_event.set()
        except Exception:
            signal.pthread_kill(main_thread, signal.SIGINT)  # its manager is gone: the Ctrl+C path

    def on_sigterm(signum, frame):
        if os.getpid() != main_pid:  # a forked child (LitServe's manager, an HTTP process after its own stop)
            if state is None or state.stopping:
                raise SystemExit(0)
            return  # the main process drains; the children serve until it is done
        if state is None or state.draining:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one shutdown at a time
            raise KeyboardInterrupt
        logger.warning("SIGTERM: draining (new requests get 503), at most %gs", drain_timeout)
        state.start_draining()
        threading.Thread(target=drain, name="drain", daemon=True).start()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    stop_watching = threading.Event()
    if state is not None:
        threading.Thread(target=watch_heartbeats, args=(state, stop_watching), name="heartbeats", daemon=True).start()
    try:
        server.uvicorn_graceful_timeout = max(UVICORN_GRACE_S, drain_timeout)  # LitServe's join of its HTTP processes
        server.run(host=BindHost(host), port=port, log_level=log_level, generate_client_file=False)
    except KeyboardInterrupt:
        pass  # also raised while workers were still starting, before LitServe's own handler is set up
    finally:
        stop_watching.set()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if state is not None:
            state.start_stopping()
        reap_children()
        signal.signal(signal.SIGTERM, previous)


class BindHost(str):
    """A host for LitServer.run, which accepts only "0.0.0.0", "127.0.0.1" and "::" before handing the host
    to uvicorn (which binds any name or address: "localhost", "::1", one interface's address). Equal to
    those three for that check only; its value is the host itself."""

    def __eq__(self, other) -> bool:
        return other in LITSERVE_HOSTS or str.__eq__(self, other)

    __hash__ = str.__hash__


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
