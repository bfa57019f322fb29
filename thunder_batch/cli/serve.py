"""`thunder-batch serve`: an OpenAI-compatible HTTP server, continuous batching over one Engine per worker."""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
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
    max_waiting: int | None = None,
    request_timeout: float = 600.0,
    drain_timeout: float = 30.0,
    worker_timeout: float = 30.0,
    replicas: int | None = None,
    ray_address: str | None = None,
    routing: Literal["prefix", "least_loaded"] = "prefix",
    replica_threads: int | None = None,
    log_level: Literal["debug", "info", "warning", "error"] = "info",
    **options,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching.

    Routes: POST /v1/chat/completions, POST /v1/completions (both stream with "stream": true),
    GET /v1/models, /health, /stats, /metrics (Prometheus). With --compile thunder each worker makes
    its step programs before the server accepts connections (minutes for a big model on CPU, seconds
    from the compile cache). SIGTERM drains (new requests get 503) and then stops; Ctrl+C stops at once.

    Args:
        host: Interface to bind: 127.0.0.1, ::1 or localhost (this machine only), 0.0.0.0 or :: (all
            interfaces), or one interface's address (IPv4 or IPv6).
        port: TCP port.
        api_key: Require "Authorization: Bearer <key>" on every route but /health. Default:
            $THUNDER_BATCH_API_KEY (keeps the key out of the process list); unset: no key.
        accelerator: Where engines run; "auto" picks CUDA when available.
        devices: How many devices to use (None: all).
        workers_per_device: Engines per device, each a worker process with its own B slots (on CPU,
            each with its share of torch's threads unless OMP_NUM_THREADS is set).
        max_body_bytes: Largest request body accepted; larger ones get 413.
        max_waiting: Requests each worker may hold beyond its B slots; past (B + max_waiting) x workers
            requests in flight the server answers 429 with Retry-After. Default: no bound (requests
            wait for a slot, each at most the request timeout), as vLLM and llama-server.
        request_timeout: Seconds a request may wait and run; then it ends (504, or an error event in a
            stream) and frees its slot. 0: no timeout.
        drain_timeout: Seconds SIGTERM waits for requests in flight before stopping (SIGTERM to the main
            process or to its whole process group; the other processes wait for the main one).
        worker_timeout: Seconds without a heartbeat from a ready worker's event loop (stopped, deadlocked)
            before it is killed and restarted; its requests get 503. 0: never. With --replicas: Ray's
            health check timeout, after which the replica is replaced.
        replicas: Serve N engine replicas as a Ray Serve application (needs the `ray` extra) instead of
            LitServe workers: each replica gets --replica_threads torch threads (or one GPU with
            --accelerator cuda), and a router sends each request to the replica holding its longest prompt prefix.
        ray_address: With --replicas, the Ray cluster to run on ("auto": the one this node belongs to).
            Default: a local Ray instance, started and stopped with this command.
        routing: With --replicas: "prefix" (a session's replica, else the longest cached prefix's while
            it is at most a few requests busier than the least loaded, else the least loaded) or
            "least_loaded".
        replica_threads: With --replicas on CPU: torch threads (and Ray CPUs) per replica. Default: this
            machine's cores // replicas; fewer leave cores to Ray's own processes.
        log_level: LitServe and uvicorn log level (Ray Serve's with --replicas).
    """
    from thunder_batch.checkpoints import default_checkpoint_dir, validate_checkpoint_dir

    engine_options = EngineOptions(**options)
    engine_options.engine_config()  # a bad value fails here, not in every worker
    _check_limits(max_waiting=max_waiting, request_timeout=request_timeout, worker_timeout=worker_timeout)
    for name, value in [("replicas", replicas), ("replica_threads", replica_threads)]:
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    checkpoint_dir = engine_options.checkpoint_dir
    # Convert the default model here, once, before any worker starts.
    checkpoint_dir = default_checkpoint_dir() if checkpoint_dir is None else validate_checkpoint_dir(checkpoint_dir)
    engine_options = replace(engine_options, checkpoint_dir=checkpoint_dir)
    api_key = api_key or os.environ.get("THUNDER_BATCH_API_KEY") or None
    if api_key is None and not _loopback(host):
        print(
            f"warning: serving on {host} without an API key: anyone who reaches port {port} can use it "
            "(set THUNDER_BATCH_API_KEY)",
            file=sys.stderr,
        )
    limits = dict(max_body_bytes=max_body_bytes, max_waiting=max_waiting, request_timeout=request_timeout or None)
    limits.update(worker_timeout=worker_timeout or None)
    if replicas is not None:
        ray = dict(replicas=replicas, ray_address=ray_address, routing=routing, drain_timeout=drain_timeout)
        ray.update(log_level=log_level, replica_threads=replica_threads)
        return _serve_replicas(engine_options, limits, dict(ray, accelerator=accelerator), host, port, api_key)
    metrics_dir = _metrics_dir()
    try:
        devices = "auto" if devices is None else devices
        server, state = build_server(
            engine_options,
            api_key=api_key,
            accelerator=accelerator,
            devices=devices,
            **limits,
            workers_per_device=workers_per_device,
        )
        run_server(server, host, port, log_level, state, drain_timeout)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _check_limits(**limits) -> None:
    for name, value in limits.items():
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def _serve_replicas(options: EngineOptions, limits: dict, ray: dict, host: str, port: int, api_key) -> None:
    """Run ray["replicas"] engines as a Ray Serve application (the `ray` extra) until SIGTERM."""
    try:
        from thunder_batch.serve.ray_app import ReplicaSettings, run_replicas
        from thunder_batch.serve.routes import ServeSettings
    except ImportError as e:
        raise SystemExit(f"--replicas needs Ray Serve: pip install 'thunder_batch[ray]' ({e})") from None
    if ray["accelerator"] == "auto":
        import torch

        ray["accelerator"] = "cuda" if torch.cuda.is_available() else "cpu"
    model, batch_size = Path(options.checkpoint_dir).name, options.engine_config().batch_size
    worker_timeout = limits.pop("worker_timeout")
    settings = ServeSettings(model=model, batch_size=batch_size, workers=ray["replicas"], **limits)
    run_replicas(options, settings, ReplicaSettings(worker_timeout=worker_timeout, **ray), host, port, api_key)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _metrics_dir() -> str | None:
    """Prometheus' multiprocess directory, made before any process that records metrics starts
    (ours, removed at the end), unless the operator set $PROMETHEUS_MULTIPROC_DIR."""
    from thunder_batch.serve.metrics import MULTIPROC_ENV

    if os.environ.get(MULTIPROC_ENV):
        return None
    path = tempfile.mkdtemp(prefix="thunder-batch-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path
