"""Prometheus metrics of `thunder-batch serve`, aggregated over every process.

Counters and histograms use prometheus_client's multiprocess mode (each process writes its own
files under $PROMETHEUS_MULTIPROC_DIR, which the serve command sets before any process starts;
the /metrics handler merges them); gauges are read from the shared state at scrape time. Without
that variable (tests in one process) the metrics live in a registry of their own. Names follow
vLLM's (`vllm:num_requests_running` -> `thunder_batch:num_requests_running`, ...), so a vLLM
dashboard fits after renaming the prefix. prometheus_client is imported on first use, after the
serve command has set the directory.
"""

from __future__ import annotations

import os

PREFIX = "thunder_batch:"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The metrics one process records (worker or HTTP side); `model` labels every series."""

    def __init__(self, model: str) -> None:
        import prometheus_client as pc

        self.model = model
        self.multiprocess = MULTIPROC_ENV in os.environ
        self.registry = None if self.multiprocess else pc.CollectorRegistry()
        label = ["model_name"]

        def counter(name, doc, labels=()):
            return pc.Counter(PREFIX + name, doc, [*label, *labels], registry=self.registry)

        def histogram(name, doc, buckets, labels=()):
            return pc.Histogram(PREFIX + name, doc, [*label, *labels], buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens read (each choice reads its prompt)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.request_success = counter(
            "request_success", "Requests finished, by reason (stop, length, abort, timeout, error)", ["finished_reason"]
        )
        self.request_rejected = counter("request_rejected", "Requests refused at the door, by status", ["status"])
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last byte of the answer", E2E_BUCKETS)
        self.step = histogram("step_duration_seconds", "Engine step time, by step shape", ITL_BUCKETS, ["shape"])
        self.failed_steps = counter("failed_steps", "Engine steps that raised")
        self.compile_cache_hits = counter("compile_cache_hits", "Step program pieces loaded from the compile cache")
        self.compiled_pieces = counter("compiled_pieces", "Step program pieces traced by Thunder")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the slots' kept caches (requests admitted)"
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens taken from a slot's cache instead of computed (of those looked up)"
        )
        self._prefix_seen = (0, 0)

    def count_prefix_cache(self, queries: int, hits: int) -> None:
        """Advance the prefix cache counters to the engine's running totals (tokens, as vLLM counts). A
        failed step takes its copies' hits back from the engine's total; the counters never go down."""
        seen_queries, seen_hits = self._prefix_seen
        if queries > seen_queries:
            self.labels(self.prefix_cache_queries).inc(queries - seen_queries)
        if hits > seen_hits:
            self.labels(self.prefix_cache_hits).inc(hits - seen_hits)
        self._prefix_seen = (max(queries, seen_queries), max(hits, seen_hits))

    def labels(self, metric, **labels):
        return metric.labels(model_name=self.model, **labels)

    def render(self, state=None) -> bytes:
        """Every process's metrics in Prometheus text format, with gauges from the shared state."""
        import prometheus_client as pc
        from prometheus_client import multiprocess

        registry = self.registry
        if self.multiprocess:
            registry = pc.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        text = pc.generate_latest(registry)
        return text + (_gauges(state, self.model) if state is not None else b"")


def _gauges(state, model: str) -> bytes:
    """Gauges read from the shared state now (prometheus text format)."""
    workers = state.all_workers()
    running = sum(w.running for w in workers)
    in_flight = state.in_flight()
    lines = []

    def gauge(name: str, doc: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} gauge"])
        lines.extend(f'{PREFIX}{name}{{model_name="{model}"{extra}}} {value}' for extra, value in samples)

    gauge("num_requests_running", "Requests in a slot", [("", running)])
    gauge("num_requests_waiting", "Requests accepted and not yet in a slot", [("", max(in_flight - running, 0))])
    gauge("num_requests_in_flight", "Requests accepted and not yet finished", [("", in_flight)])
    gauge(
        "num_slots",
        "Slots of every worker's engine (a running request holds one)",
        [("", sum(w.slots for w in workers))],
    )
    capacity = sum(w.kv_capacity for w in workers)
    usage = sum(w.kv_tokens for w in workers) / capacity if capacity else 0.0
    gauge("kv_cache_usage_perc", "KV-cache entries running requests hold, as a fraction (1 = full)", [("", usage)])
    gauge(
        "worker_healthy",
        "1 when the worker can serve",
        [(f',worker="{w.index}"', int(w.problem() is None)) for w in workers],
    )
    gauge("server_draining", "1 while the server drains before stopping", [("", int(state.draining))])
    return ("\n".join(lines) + "\n").encode()


def merge_replicas(own: str, texts: dict[str, str]) -> bytes:
    """One Prometheus text of a process's own series (`own`, as they are) and several replicas' (each sample
    labelled with its replica): every family once, its samples together, as the text format requires (a
    family both declare, such as the request counters, would otherwise be declared twice and fail a
    scrape). texts: replica id -> its /metrics text."""
    import prometheus_client as pc
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for replica, text in [(None, own), *sorted(texts.items())]:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = pc.metrics_core.Metric(family.name, family.documentation, family.type)
            labels = {} if replica is None else {"replica": replica}
            merged.samples += [s._replace(labels={**s.labels, **labels}) for s in family.samples]

    class Merged:
        def collect(self):
            return list(families.values())

    return pc.generate_latest(Merged())
