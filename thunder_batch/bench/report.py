"""Benchmark results: per-run numbers, greedy-token checks, speedups, targets, table, JSON and plot."""

from __future__ import annotations

import json
import math
import os
import platform
import sys

from thunder_batch.bench.metrics import ModelCost, latency_metrics, throughput_metrics, useful_flops
from thunder_batch.bench.parity import compare_tokens
from thunder_batch.bench.system import SystemRun
from thunder_batch.versions import package_versions

SEQUENTIAL, BATCHED, EAGER = "litgpt-sequential", "litgpt-batched", "eager"
TARGETS = dict(vs_litgpt_sequential=12.0, vs_litgpt_batched=2.0, vs_eager=1.2, decode_peak_fraction_b32=0.4)


def is_thunder(system: str) -> bool:
    return system.startswith("thunder-")


def step_metrics(run: SystemRun, cost: ModelCost, peaks: dict, kv_bytes_per_slot_step: float) -> dict:
    """Occupancy and decode-step FLOP/s and bandwidth from an engine run's step records."""
    if not run.steps:
        return {}
    B = run.batch_size
    decode = [s for s in run.steps if s.width == 1]
    full = [s for s in decode if len(s.spans) == B]
    out = dict(steps=len(run.steps), prefill_steps=len(run.steps) - len(decode), decode_steps=len(decode),
               slot_occupancy=sum(len(s.spans) for s in run.steps) / (B * len(run.steps)))
    for name, steps in (("decode", decode), ("full_decode", full)):
        seconds = sum(s.seconds for s in steps)
        if not steps or seconds <= 0:
            continue
        flops = sum(cost.span_flops(p, n) + 2 * cost.lm_head_params for s in steps for p, n in s.spans)
        nbytes = len(steps) * (cost.weight_bytes + B * kv_bytes_per_slot_step)
        out[name] = dict(steps=len(steps), mean_step_ms=1000 * seconds / len(steps), flops_per_s=flops / seconds,
                         peak_matmul_fraction=flops / seconds / peaks["matmul_flops_per_s"],
                         bytes_per_s=nbytes / seconds,
                         copy_bandwidth_fraction=nbytes / seconds / peaks["copy_bytes_per_s"])
    return out


def run_metrics(run: SystemRun, cost: ModelCost, peaks: dict, kv_bytes_per_slot_step: float) -> dict:
    throughput = throughput_metrics(run.traces, run.wall_s)
    flops = useful_flops(cost, run.traces)
    return dict(system=run.system, batch_size=run.batch_size, **throughput, **latency_metrics(run.traces),
                useful_flops=flops, flops_per_s=flops / max(run.wall_s, 1e-9),
                peak_matmul_fraction=flops / max(run.wall_s, 1e-9) / peaks["matmul_flops_per_s"],
                ttft_samples_ms=[1000 * t.ttft for t in run.traces if t.ttft is not None],
                compile=run.compile, memory=run.memory, **step_metrics(run, cost, peaks, kv_bytes_per_slot_step),
                notes=run.notes, **run.extra)


def reference_run(runs: list[SystemRun]) -> SystemRun | None:
    """The engine's tokens every baseline is checked against: eager if it ran, else the first engine system."""
    engine_runs = [r for r in runs if r.system == EAGER] or [r for r in runs if is_thunder(r.system)]
    return engine_runs[0] if engine_runs else None


def check_all(runs: list[SystemRun], metrics: list[dict]) -> str | None:
    """Add `token_check` to each run's metrics (in place); returns the reference's label."""
    ref = reference_run(runs)
    if ref is None:
        return None
    expected = [t.token_ids for t in ref.traces]
    for run, m in zip(runs, metrics):
        if run is not ref:
            m["token_check"] = compare_tokens(expected, [t.token_ids for t in run.traces])
    return f"{ref.system}@B={ref.batch_size}"


def _rate(metrics: list[dict], system: str, batch_size: int | None) -> float | None:
    for m in metrics:
        if m["system"] == system and m["batch_size"] == batch_size:
            return m["output_tokens_per_s"]
    return None


def speedups(metrics: list[dict]) -> dict:
    """Per run: output tokens/s over litgpt-sequential, litgpt-batched and eager at the same B."""
    seq = _rate(metrics, SEQUENTIAL, None)
    table = {}
    for m in metrics:
        if m["batch_size"] is None:
            continue
        rate, B = m["output_tokens_per_s"], m["batch_size"]
        bases = dict(vs_litgpt_sequential=seq, vs_litgpt_batched=_rate(metrics, BATCHED, B),
                     vs_eager=_rate(metrics, EAGER, B))
        ratios = {key: rate / base for key, base in bases.items() if base}
        m["speedup"] = ratios
        table.setdefault(f"B={B}", {})[m["system"]] = ratios.get("vs_litgpt_sequential")
    return table


def target_row(name: str, target: float, measured: float | None, where: str) -> dict:
    if measured is None:
        return dict(target=name, where=where, goal=target, measured=None, met=None, note="not measured")
    met = measured >= target
    note = "met" if met else f"missed by {100 * (1 - measured / target):.1f}% ({measured:.3f} vs {target})"
    return dict(target=name, where=where, goal=target, measured=measured, met=met, note=note)


def targets(metrics: list[dict]) -> list[dict]:
    """The performance targets (docs/DESIGN.md), for the best Thunder system at each batch size."""
    rows = []
    for B in sorted({m["batch_size"] for m in metrics if m["batch_size"] is not None}):
        thunder = [m for m in metrics if m["batch_size"] == B and is_thunder(m["system"])]
        if not thunder:
            continue
        best = max(thunder, key=lambda m: m["output_tokens_per_s"])
        where = f"{best['system']} B={B}"
        for key in ("vs_litgpt_sequential", "vs_litgpt_batched", "vs_eager"):
            rows.append(target_row(f"output tok/s {key}", TARGETS[key], best["speedup"].get(key), where))
        if B == 32:
            frac = best.get("full_decode", best.get("decode", {})).get("peak_matmul_fraction")
            rows.append(target_row("decode FLOP/s / peak matmul", TARGETS["decode_peak_fraction_b32"], frac, where))
    if not any(m["batch_size"] == 32 for m in metrics):
        target = TARGETS["decode_peak_fraction_b32"]
        rows.append(target_row("decode FLOP/s / peak matmul", target, None, "B=32 not run"))
    return rows


def machine_info(device) -> dict:
    import torch

    versions = package_versions(("torch", "lightning-thunder", "litgpt", "thunder_batch", "tokenizers", "litserve"))
    cpu = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines()
                if line.startswith("MemTotal")), None)
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    return dict(versions=versions, python=sys.version.split()[0], platform=platform.platform(), cpu=cpu,
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(), memory_bytes=mem, gpu=gpu,
                device=str(device), loadavg=os.getloadavg())


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def clean(obj):
    """JSON-safe: NaN/inf -> None, tuples -> lists, other objects -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def write_json(result: dict, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(clean(result), f, indent=2, allow_nan=False)
