"""`thunder-batch serve`: an OpenAI-compatible HTTP server, continuous batching over one Engine per worker."""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import replace
from typing import Literal

from thunder_batch.cli.options import EngineOptions
from thunder_batch.serve.server import build_server, run_server  # litserve missing: `serve` is unavailable


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    accelerator: Literal["auto", "cpu", "cuda"] = "auto",
    devices: int | None = None,
    workers_per_device: int = 1,
    max_body_bytes: int = 1_000_000,
    log_level: Literal["debug", "info", "warning", "error"] = "info",
    **options,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching.

    Routes: POST /v1/chat/completions, POST /v1/completions (both stream with "stream": true),
    GET /v1/models, GET /health. Stops cleanly on Ctrl+C or SIGTERM. With --compile thunder each
    worker traces the step program before the server accepts connections (minutes for a big model on CPU).

    Args:
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
    from thunder_batch.checkpoints import default_checkpoint_dir, validate_checkpoint_dir

    engine_options = EngineOptions(**options)
    engine_options.engine_config()  # a bad value fails here, not in every worker
    checkpoint_dir = engine_options.checkpoint_dir
    # Convert the default model here, once, before any worker starts.
    checkpoint_dir = default_checkpoint_dir() if checkpoint_dir is None else validate_checkpoint_dir(checkpoint_dir)
    api_key = api_key or os.environ.get("THUNDER_BATCH_API_KEY") or None
    with multiprocessing.Manager() as manager:  # run_server stops it with the other children
        server = build_server(
            replace(engine_options, checkpoint_dir=checkpoint_dir),
            manager.dict(),
            api_key=api_key,
            accelerator=accelerator,
            devices="auto" if devices is None else devices,
            workers_per_device=workers_per_device,
            max_body_bytes=max_body_bytes,
        )
        run_server(server, host, port, log_level)
