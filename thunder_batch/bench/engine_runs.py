"""The engine as a benchmark system: eager, or under Thunder with one executor choice.

Requests enter through `add_request` at their arrival times and every token comes out of `step()`,
the same primitive the server drives. Each step is timed (shape, slots, positions) for occupancy
and FLOP accounting; compile time is measured cold (traced into a fresh compile cache) and warm
(a second engine loading the same cache).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass

import torch

from thunder_batch.bench.metrics import PeakMemory, RequestTrace
from thunder_batch.bench.system_run import BenchContext, SystemRun, fresh_model, progress_bar
from thunder_batch.bench.workloads import BenchRequest
from thunder_batch.config import EngineConfig, SamplingParams
from thunder_batch.observe import StepEvent

# system name -> executors (None: eager; (): Thunder with the default executors, `executors=None`).
# sdpa is listed so attention is not decomposed.
ENGINE_SYSTEMS = {
    "eager": None,
    "thunder-default": (),
    "thunder-torch": ("sdpa", "torch"),
    "thunder-torchcompile": ("torchcompile", "torch"),
    "thunder-nvfuser": ("nvfuser", "sdpa", "torch"),
}


@dataclass(frozen=True)
class StepRecord:
    lanes: int  # prefill lanes of the step's shape (0: decode only)
    length: int  # cache entries the step read (its rung of the attention-length ladder)
    spans: tuple[tuple[int, int], ...]  # (start_pos, n_tokens) per slot fed
    seconds: float


class StepRecorder:
    """Every step of one engine (an observer: `Engine.observers`), and the seconds spent building their input
    tensors."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []
        self.inputs_seconds = 0.0

    def __call__(self, event: StepEvent) -> None:
        spans = tuple((w.start_pos, len(w.token_ids)) for w in event.plan.work)
        self.steps.append(StepRecord(event.shape.lanes, event.shape.length, spans, event.seconds))
        self.inputs_seconds += event.inputs_seconds


def engine_config(system: str, batch_size: int, ctx: BenchContext, cache_dir: str | None) -> EngineConfig:
    shape = dict(
        batch_size=batch_size,
        max_seq_length=ctx.max_seq_length,
        prefill_chunk=ctx.prefill_chunk,
        prefill_lanes=min(ctx.prefill_lanes, batch_size),
        max_prefill_lanes=None if ctx.max_prefill_lanes is None else min(ctx.max_prefill_lanes, batch_size),
        attention_lengths=ctx.attention_lengths,
        prefix_reuse=ctx.prefix_reuse,
        prefix_store_mb=ctx.prefix_store_mb,
    )
    executors = ENGINE_SYSTEMS[system]
    if executors is None:
        return EngineConfig(**shape, compile="eager")
    return EngineConfig(**shape, compile="thunder", executors=executors or None, cache_dir=cache_dir)


def build_engine(gpt, config: EngineConfig, ctx: BenchContext):
    from thunder_batch.engine import Engine

    return Engine(fresh_model(gpt, ctx.max_seq_length), config, tokenizer=ctx.tokenizer)


def compile_engine(gpt, system: str, batch_size: int, ctx: BenchContext):
    """(engine ready to run, compile info). Thunder: a cold engine traces every step width into the
    compile cache, then (warm_compile) a second engine loads them from it; the warm one runs."""
    cache_dir = ctx.cache_dir or tempfile.mkdtemp(prefix="thunder_batch_bench_cache_")
    config = engine_config(system, batch_size, ctx, cache_dir)
    engine = build_engine(gpt, config, ctx)
    seconds = engine.warmup(progress=ctx.progress)
    if config.compile == "eager":
        return engine, dict(first_step_s=sum(seconds.values()), per_shape_s=seconds), []
    info = dict(
        cold_s=sum(seconds.values()),
        cold_per_shape_s=seconds,
        traced=engine.stats()["traced"],
        cache_dir=cache_dir,
        executors=list(config.executors) if config.executors is not None else "the defaults (executors=None)",
    )
    not_stored = engine.stats()["not_stored"]
    notes = []
    if not ctx.warm_compile:
        notes.append("warm compile not measured (--warm-compile false)")
    elif not_stored:
        notes.append(
            f"warm compile not measured: {not_stored} traced programs could not be stored in the "
            "compile cache (a reload would retrace)"
        )
    else:
        del engine
        engine = build_engine(gpt, config, ctx)
        warm = engine.warmup(progress=ctx.progress)
        info.update(warm_s=sum(warm.values()), warm_per_shape_s=warm, disk_cache_hits=engine.stats()["disk_cache_hits"])
    return engine, info, notes


def drive(engine, workload: list[BenchRequest], ctx: BenchContext, desc: str) -> tuple[list[RequestTrace], float]:
    """Add each request at its arrival time and step until all finish; returns traces and wall seconds."""
    pending = deque(sorted(workload, key=lambda r: r.arrival_s))
    traces: dict[int, RequestTrace] = {}
    with progress_bar(len(workload), desc, ctx.progress) as bar:
        t0 = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and t0 + pending[0].arrival_s <= time.perf_counter():
                r = pending.popleft()
                traces[r.index] = RequestTrace(len(r.prompt_ids), t0 + r.arrival_s)
                params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, ignore_eos=ctx.ignore_eos)
                engine.add_request(list(r.prompt_ids), params, request_id=r.index)
            if not engine.has_unfinished():
                time.sleep(max(0.0, t0 + pending[0].arrival_s - time.perf_counter()))
                continue
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                traces[out.request_id].record(out.token_ids, now)
                bar.update(int(out.finished))
        wall = time.perf_counter() - t0
    return [traces[r.index] for r in workload], wall


def host_share(recorder: StepRecorder, wall: float) -> dict:
    """Host-side work as a share of the run's wall time: building input tensors, and everything
    outside `runner.run` (scheduling, token appends, stop checks, detokenization; arrival waits in
    online runs)."""
    in_steps = sum(s.seconds for s in recorder.steps)
    outside = max(wall - in_steps, 0.0)
    return dict(
        inputs_s=recorder.inputs_seconds,
        outside_steps_s=outside,
        share=(recorder.inputs_seconds + outside) / max(wall, 1e-9),
    )


def profile_decode_step(probe_step, batch_size: int, top: int = 12) -> dict:
    """Profile one padding-only decode step at the ladder's first rung (a decode step computes all B rows):
    `probe_step`, the engine's."""
    from torch.profiler import ProfilerActivity, profile

    probe_step()  # warm
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        probe_step()
    step_s = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) or 1
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [
        dict(op=e.key, calls=e.count, self_ms=e.self_cpu_time_total / 1000, fraction=e.self_cpu_time_total / total)
        for e in events[:top]
    ]
    return dict(batch_size=batch_size, step_ms=1000 * step_s, top_ops=ops)


def run_engine(gpt, workload: list[BenchRequest], system: str, batch_size: int, ctx: BenchContext) -> SystemRun:
    """Compile (cold, warm), run the workload through add_request/step, optionally profile one step."""
    with PeakMemory(ctx.device) as memory:
        engine, compile_info, notes = compile_engine(gpt, system, batch_size, ctx)
        traced_before = engine.stats()["thunder_traces"]
        recorder = engine.observers.add(StepRecorder())
        traces, wall = drive(engine, workload, ctx, f"{system} B={batch_size}")
        engine.observers.remove(recorder)
    stats = engine.stats()
    extra = dict(
        engine_stats={k: v for k, v in stats.items() if k != "step_shapes"},
        # Thunder's own count of its traces: compiling is done before the timed run, so any trace is a retrace.
        recompiled=stats["thunder_traces"] > traced_before,
        host=host_share(recorder, wall),
    )
    if ctx.profile:
        extra["profile"] = profile_decode_step(engine.probe_step, batch_size)
    precision = str(gpt.transformer.wte.weight.dtype).removeprefix("torch.")
    print(
        f"[bench] {system} {precision} B={batch_size}: {sum(len(t.token_ids) for t in traces)} tokens in {wall:.1f}s",
        file=sys.stderr,
    )
    return SystemRun(system, batch_size, traces, wall, memory.as_dict(), compile_info, recorder.steps, notes, extra)
