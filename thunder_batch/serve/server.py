"""The main process of `thunder-batch serve`: assemble the LitServer, run it, and stop every child.

LitServe starts the HTTP processes (`routes`) and the inference workers (`worker`) from here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path

import litserve as ls

from thunder_batch.serve.routes import OpenAIRoutes, install_error_handlers
from thunder_batch.serve.worker import EngineAPI


def build_server(
    options,
    cancel_board,
    *,
    api_key: str | None = None,
    accelerator: str = "auto",
    devices: int | str = "auto",
    workers_per_device: int = 1,
    max_body_bytes: int = 1_000_000,
) -> ls.LitServer:
    """A LitServer with the OpenAI routes over one EngineAPI. `options`: EngineOptions with a resolved
    checkpoint_dir; `cancel_board`: a manager dict shared by the HTTP processes and the workers
    (uid -> time a client abandoned it)."""
    routes = OpenAIRoutes(Path(options.checkpoint_dir).name, cancel_board, max_body_bytes)
    api = EngineAPI(options, routes, cancel_board, api_key)
    server = ls.LitServer(
        api, accelerator=accelerator, devices=devices, workers_per_device=workers_per_device, timeout=False
    )
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
