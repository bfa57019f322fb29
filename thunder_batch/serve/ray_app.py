"""`thunder-batch serve --replicas N`: N engine replicas as a Ray Serve application, run until SIGTERM.

Two deployments: `Engine` (N replicas, each one EngineReplica pinned to its share of the cores through
OMP_NUM_THREADS and as many Ray CPUs, or one GPU) and the ingress (`ray_ingress`: the OpenAI routes on
Serve's HTTP proxy, no CPU reserved). The ingress calls the engine through a deployment handle whose
router is `prefix_router.PrefixRouter`. Ray restarts a replica that dies and replaces one whose health
check (`check_health`) fails or times out (`--worker_timeout`). SIGTERM drains (new requests 503, those in
flight finish, at most `--drain_timeout`), then the application is deleted and a Ray started here stops.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

from thunder_batch.serve.prefix_router import PrefixRouter, RouteKey
from thunder_batch.serve.ray_ingress import ReplicaRoutes, build_ingress_app
from thunder_batch.serve.replicas import EngineReplica
from thunder_batch.serve.routes import ServeSettings

logger = logging.getLogger(__name__)
APP_NAME = "thunder-batch"
ENGINE = "Engine"
MAX_ONGOING = 100_000  # a replica queues in its engine: Ray's default of 5 would hold the sixth chat back
DRAIN_POLL_S = 0.1


@dataclass(frozen=True)
class ReplicaSettings:
    """How the replicas run: how many, where, how they are routed, when they count as stuck."""

    replicas: int = 2
    ray_address: str | None = None  # None: a local Ray started here; "auto": the cluster this node is in
    routing: str = "prefix"  # PrefixRouter's policy: "prefix" or "least_loaded"
    accelerator: str = "cpu"  # "cuda": one GPU per replica
    worker_timeout: float | None = 30.0  # health check timeout (None: Ray's default)
    drain_timeout: float = 30.0
    log_level: str = "info"  # Ray Serve's logs (its access log is at info)
    replica_threads: int | None = None  # None: this machine's cores // replicas

    def threads(self) -> int:
        return self.replica_threads or max(1, (os.cpu_count() or 1) // self.replicas)


class EngineDeployment:
    """One engine replica behind Ray Serve (see `replicas.EngineReplica`)."""

    def __init__(self, options, model: str, device: str) -> None:
        from ray import serve

        self.replica = EngineReplica.build(options, model, device)
        self.id = serve.get_replica_context().replica_id.unique_id

    async def generate(self, payload: dict, route: RouteKey | None = None):
        async for item in self.replica.generate(payload):
            yield item

    async def check_health(self) -> None:
        await self.replica.check_health()

    def stats(self, route: RouteKey | None = None) -> dict:
        return dict(self.replica.stats(), replica=self.id)

    def metrics_text(self, route: RouteKey | None = None) -> dict:
        return {"replica": self.id, "text": self.replica.metrics_text()}


class Ingress:
    """The HTTP side (see `ray_ingress`); its app is built on the replica, once the handle exists."""

    def __init__(self, engine, settings: ServeSettings, replicas: int, api_key: str | None) -> None:
        """engine: the engine deployment's handle (Ray binds it)."""
        self.routes = ReplicaRoutes(settings, engine, replicas)
        self.api_key = api_key

    def __serve_build_asgi_app__(self):
        return build_ingress_app(self.routes, self.api_key)

    def start_draining(self) -> None:
        self.routes.state.start_draining()

    def in_flight(self) -> int:
        return self.routes.state.in_flight()


def build_app(engine_options, settings: ServeSettings, replicas: ReplicaSettings, api_key: str | None):
    """The Ray Serve application: the ingress bound to N engine replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    threads = replicas.threads()
    cuda = replicas.accelerator == "cuda"
    actor = {"num_gpus": 1} if cuda else {"num_cpus": threads}
    actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    health = {}
    if replicas.worker_timeout:
        health = dict(
            health_check_timeout_s=replicas.worker_timeout, health_check_period_s=min(replicas.worker_timeout / 3, 10)
        )
    engine = serve.deployment(EngineDeployment).options(
        name=ENGINE,
        num_replicas=replicas.replicas,
        ray_actor_options=actor,
        max_ongoing_requests=MAX_ONGOING,
        graceful_shutdown_timeout_s=replicas.drain_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixRouter, request_router_kwargs={"policy": replicas.routing}
        ),
        **health,
    )
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING
    )
    engine_app = engine.bind(engine_options, settings.model, "cuda" if cuda else "cpu")
    return ingress.bind(engine_app, settings, replicas.replicas, api_key)


def run_replicas(
    engine_options, settings: ServeSettings, replicas: ReplicaSettings, host: str, port: int, api_key
) -> None:
    """Start the application (on a local Ray unless an address is given), serve until SIGTERM or Ctrl+C."""
    import ray
    from ray import serve

    local = replicas.ray_address is None
    level = replicas.log_level.upper()
    cpus = os.cpu_count() if local else None
    ray.init(address=replicas.ray_address, num_cpus=cpus, include_dashboard=False, logging_level=level)
    stop, sigterm = threading.Event(), threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: (sigterm.set(), stop.set()))
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": level})
        app = build_app(engine_options, settings, replicas, api_key)
        serve.run(app, name=APP_NAME, route_prefix="/", logging_config={"log_level": level})
        logger.warning("serving %d replicas on http://%s:%d", replicas.replicas, host, port)
        stop.wait()  # a signal's handler runs between waits of the main thread: SIGTERM or Ctrl+C end it
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if sigterm.is_set():
            drain(replicas.drain_timeout)
        _stop(local)
        signal.signal(signal.SIGTERM, previous)


def drain(timeout: float) -> None:
    """New requests get 503 while those in flight finish (at most `timeout` seconds)."""
    from ray import serve

    ingress = serve.get_app_handle(APP_NAME)
    logger.warning("SIGTERM: draining (new requests get 503), at most %gs", timeout)
    ingress.start_draining.remote().result()
    deadline = time.monotonic() + timeout
    while (left := ingress.in_flight.remote().result()) and time.monotonic() < deadline:
        time.sleep(DRAIN_POLL_S)
    if left:
        logger.warning("drain timeout (%gs): stopping with %d requests in flight", timeout, left)


def _stop(local: bool) -> None:
    import ray
    from ray import serve

    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)  # the cluster's Serve keeps running for its other applications
    finally:
        if local:
            ray.shutdown()
