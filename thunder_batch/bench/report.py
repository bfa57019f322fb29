"""Benchmark results: per-run numbers, greedy-token checks, speedups, targets, table, JSON and plot."""

from __future__ import annotations

import json
import math
import os
import platform
import sys

from thunder_batch.bench.metrics import ModelCost, latency_metrics, percentile, throughput_metrics, useful_flops
from thunder_batch.bench.parity import compare_tokens
from thunder_batch.bench.system_run import SystemRun
from thunder_batch.versions import package_versions

SEQUENTIAL, BATCHED, EAGER = "litgpt-sequential", "litgpt-batched", "eager"
HF_PEERS = ("hf-transformers", "hf-transformers-compile")
TARGETS = dict(
    vs_litgpt_sequential=12.0,
    vs_litgpt_batched=2.0,
    vs_eager=1.3,
    decode_peak_fraction=0.4,
    admit_vs_decode_step=1.5,
    one_request_decode_tok_s=35.0,  # bf16, B=1: the latency a single user sees
    cold_s_per_shape=20.0,  # at most
    warm_over_cold=0.15,  # at most: a second start loads what the first compiled
)
# Over Hugging Face transformers' static batches: equal-length outputs, mixed outputs (its batches wait for
# their longest member), and the fastest Thunder run (at its B).
HF_TARGETS = dict(equal_outputs=1.0, mixed_outputs=1.5, best=3.0)
RATIOS = ("vs_litgpt_sequential", "vs_litgpt_batched", "vs_eager")


def is_thunder(system: str) -> bool:
    return system.startswith("thunder-")


def step_metrics(run: SystemRun, cost: ModelCost, peaks: dict, kv_bytes_per_entry: float) -> dict:
    """Occupancy, steps per shape, what a step that admits prompt tokens costs over a decode-only step,
    and decode-step FLOP/s and bandwidth from an engine run's step records (FLOP/s as a fraction of the
    peak matmul at the run's own precision)."""
    if not run.steps:
        return {}
    B, peak = run.batch_size, peaks["matmul_flops_per_s"][run.precision]
    decode = [s for s in run.steps if s.lanes == 0]
    full = [s for s in decode if len(s.spans) == B]
    out = dict(
        steps=len(run.steps),
        prefill_steps=len(run.steps) - len(decode),
        decode_steps=len(decode),
        slot_occupancy=sum(len(s.spans) for s in run.steps) / (B * len(run.steps)),
        step_shapes=shape_summary(run.steps),
        admit_vs_decode_step=admit_ratio(run.steps),
    )
    for name, steps in (("decode", decode), ("full_decode", full)):
        seconds = sum(s.seconds for s in steps)
        if not steps or seconds <= 0:
            continue
        flops = sum(cost.span_flops(p, n) + 2 * cost.lm_head_params for s in steps for p, n in s.spans)
        nbytes = sum(cost.weight_bytes + B * kv_bytes_per_entry * s.length for s in steps)
        out[name] = dict(
            steps=len(steps),
            mean_step_ms=1000 * seconds / len(steps),
            flops_per_s=flops / seconds,
            peak_matmul_fraction=flops / seconds / peak,
            bytes_per_s=nbytes / seconds,
            copy_bandwidth_fraction=nbytes / seconds / peaks["copy_bytes_per_s"],
        )
    return out


def shape_summary(steps) -> dict:
    """ "lanes=P L=..." -> steps of that shape and their mean milliseconds."""
    out = {}
    for lanes, length in sorted({(s.lanes, s.length) for s in steps}):
        ms = [1000 * s.seconds for s in steps if (s.lanes, s.length) == (lanes, length)]
        out[f"lanes={lanes} L={length}"] = dict(
            steps=len(ms), mean_ms=sum(ms) / len(ms), median_ms=percentile(sorted(ms), 50)
        )
    return out


def admit_ratio(steps) -> float | None:
    """Median step with the fewest prefill lanes (the step that admits a prompt beside decoding slots)
    over the median decode-only step, at the rung where most of those ran (the same L: the ratio is the
    cost of admitting, not of reading more cache). Wider steps are in `step_shapes`."""
    mixed = [s for s in steps if s.lanes]
    if not mixed:
        return None
    narrowest = min(s.lanes for s in mixed)
    rungs = [s.length for s in mixed if s.lanes == narrowest]
    length = max(set(rungs), key=rungs.count)
    decode = [s.seconds for s in steps if not s.lanes and s.length == length]
    if not decode:
        return None
    admitting = sorted(s.seconds for s in mixed if (s.lanes, s.length) == (narrowest, length))
    return percentile(admitting, 50) / percentile(sorted(decode), 50)


def run_metrics(run: SystemRun, cost: ModelCost, peaks: dict, kv_bytes_per_entry: float) -> dict:
    throughput = throughput_metrics(run.traces, run.wall_s)
    flops = useful_flops(cost, run.traces)
    rate = flops / max(run.wall_s, 1e-9)
    return dict(
        system=run.system,
        precision=run.precision,
        batch_size=run.batch_size,
        **throughput,
        **latency_metrics(run.traces),
        useful_flops=flops,
        flops_per_s=rate,
        peak_matmul_fraction=rate / peaks["matmul_flops_per_s"][run.precision],
        ttft_samples_ms=[1000 * t.ttft for t in run.traces if t.ttft is not None],
        compile=run.compile,
        memory=run.memory,
        **step_metrics(run, cost, peaks, kv_bytes_per_entry),
        notes=run.notes,
        **run.extra,
    )


def reference_run(runs: list[SystemRun]) -> SystemRun | None:
    """The engine's tokens every baseline is checked against: eager if it ran, else the first engine system."""
    engine_runs = [r for r in runs if r.system == EAGER] or [r for r in runs if is_thunder(r.system)]
    return engine_runs[0] if engine_runs else None


def check_all(runs: list[SystemRun], metrics: list[dict]) -> dict[str, str]:
    """Per precision, check every run's greedy tokens against that precision's reference run: adds
    `token_check` (or `token_reference`) to the metrics in place; returns precision -> the reference's label.
    Runs of different precisions are never compared (bf16 and fp32 legitimately pick different tokens)."""
    references = {}
    for precision in dict.fromkeys(r.precision for r in runs):
        same = [(r, m) for r, m in zip(runs, metrics) if r.precision == precision]
        ref = reference_run([r for r, _ in same])
        if ref is None:
            continue
        expected = [t.token_ids for t in ref.traces]
        for run, m in same:
            if run is ref:
                m["token_reference"] = True
            else:
                m["token_check"] = compare_tokens(expected, [t.token_ids for t in run.traces])
        references[precision] = f"{ref.system}@B={ref.batch_size}"
    return references


def _rate(metrics: list[dict], system: str, batch_size: int | None, precision: str) -> float | None:
    for m in metrics:
        if m["system"] == system and m["batch_size"] == batch_size and m["precision"] == precision:
            return m["output_tokens_per_s"]
    return None


def hf_rate(metrics: list[dict], batch_size: int | None, precision: str) -> float | None:
    """The fastest transformers peer (eager or compiled forward) at this B and precision: the base of vs_hf."""
    rates = [_rate(metrics, s, batch_size, precision) for s in HF_PEERS]
    return max((r for r in rates if r), default=None)


def sequential_baseline(metrics: list[dict]) -> dict | None:
    """The fastest litgpt-sequential run over all precisions: the baseline of vs_litgpt_sequential."""
    seq = [m for m in metrics if m["system"] == SEQUENTIAL]
    if not seq:
        return None
    best = max(seq, key=lambda m: m["output_tokens_per_s"])
    return dict(
        precision=best["precision"],
        output_tokens_per_s=best["output_tokens_per_s"],
        by_precision={m["precision"]: m["output_tokens_per_s"] for m in seq},
    )


def speedups(metrics: list[dict]) -> tuple[dict, dict | None]:
    """Per run (in place, `speedup`): output tokens/s over the fastest litgpt-sequential of any precision,
    and over litgpt-batched, eager and the fastest transformers peer at the same B and precision.
    Returns ({precision: {"B=..": {system: vs_litgpt_sequential}}}, the sequential baseline)."""
    baseline = sequential_baseline(metrics)
    table = {}
    for m in metrics:
        if m["batch_size"] is None:
            continue
        rate, B, p = m["output_tokens_per_s"], m["batch_size"], m["precision"]
        bases = dict(
            vs_litgpt_sequential=baseline and baseline["output_tokens_per_s"],
            vs_litgpt_batched=_rate(metrics, BATCHED, B, p),
            vs_eager=_rate(metrics, EAGER, B, p),
            vs_hf=hf_rate(metrics, B, p),
        )
        ratios = {key: rate / base for key, base in bases.items() if base}
        m["speedup"] = ratios
        table.setdefault(p, {}).setdefault(f"B={B}", {})[m["system"]] = ratios.get("vs_litgpt_sequential")
    return table, baseline


def target_row(
    name: str, target: float, measured: float | None, where: str, best: bool = False, at_most: bool = False
) -> dict:
    """A target met when measured >= target (at_most: when measured <= target)."""
    if measured is None:
        return dict(target=name, where=where, goal=target, measured=None, met=None, note="not measured", best=best)
    met = measured <= target if at_most else measured >= target
    note = "met" if met else f"missed by {100 * abs(measured / target - 1):.1f}% ({measured:.3f} vs {target})"
    return dict(target=name, where=where, goal=target, measured=measured, met=met, note=note, best=best)


def _where(m: dict) -> str:
    return f"{m['system']} {m['precision']} B={m['batch_size']}"


def targets(metrics: list[dict], equal_outputs: bool = False) -> list[dict]:
    """The performance targets (docs/DESIGN.md): the ratios for the best Thunder system at each (precision, B),
    and decode FLOP/s over the peak matmul at its precision for the best Thunder run of all (`best`: True).
    With a transformers peer in the run, vs_hf too, its goal set by the workload: `equal_outputs` (every request
    makes its full limit) or mixed, and HF_TARGETS["best"] at the fastest Thunder run."""
    with_hf = any(m["system"] in HF_PEERS for m in metrics)
    ratios = RATIOS + ("vs_hf",) * with_hf
    goals = dict(TARGETS, vs_hf=HF_TARGETS["equal_outputs" if equal_outputs else "mixed_outputs"])
    thunder = [m for m in metrics if is_thunder(m["system"])]
    name = "decode FLOP/s / peak matmul at its precision"
    if not thunder:
        return [target_row(name, TARGETS["decode_peak_fraction"], None, "no Thunder run")]
    best = max(thunder, key=lambda m: m["output_tokens_per_s"])
    order = list(dict.fromkeys(m["precision"] for m in metrics))
    rows = []
    for p, B in sorted({(m["precision"], m["batch_size"]) for m in thunder}, key=lambda k: (order.index(k[0]), k[1])):
        top = max(
            (m for m in thunder if (m["precision"], m["batch_size"]) == (p, B)), key=lambda m: m["output_tokens_per_s"]
        )
        where = _where(top) + (" (best)" if top is best else "")
        rows += [
            target_row(f"output tok/s {key}", goals[key], top["speedup"].get(key), where, top is best) for key in ratios
        ]
        admit = top.get("admit_vs_decode_step")
        if admit is not None:
            goal = TARGETS["admit_vs_decode_step"]
            rows.append(target_row("step admitting a prompt / decode-only step", goal, admit, where, top is best, True))
    if with_hf:
        vs_hf = best["speedup"].get("vs_hf")
        rows.append(
            target_row("output tok/s vs_hf, fastest Thunder run", HF_TARGETS["best"], vs_hf, _where(best), True)
        )
    frac = best.get("full_decode", best.get("decode", {})).get("peak_matmul_fraction")
    rows.append(target_row(name, TARGETS["decode_peak_fraction"], frac, _where(best) + " (best)", True))
    return rows + latency_and_compile_targets(thunder)


def latency_and_compile_targets(thunder: list[dict]) -> list[dict]:
    """One bf16 request's decode tok/s (the fastest Thunder run at B=1 in bf16), and the cold compile per
    step shape and warm start over cold of each Thunder system's first run that measured them."""
    rows = []
    single = [m for m in thunder if m["batch_size"] == 1 and m["precision"] == "bfloat16" and m.get("decode")]
    name = "one request's decode tok/s (bf16, B=1)"
    if single:
        top = min(single, key=lambda m: m["decode"]["mean_step_ms"])
        rows.append(
            target_row(name, TARGETS["one_request_decode_tok_s"], 1000 / top["decode"]["mean_step_ms"], _where(top))
        )
    else:
        rows.append(target_row(name, TARGETS["one_request_decode_tok_s"], None, "no Thunder run at B=1 in bf16"))
    for system in dict.fromkeys(m["system"] for m in thunder):
        compiled = next((m for m in thunder if m["system"] == system and (m.get("compile") or {}).get("cold_s")), None)
        if compiled is None:
            continue
        c, where = compiled["compile"], _where(compiled)
        per_shape = c["cold_s"] / max(len(c.get("cold_per_shape_s") or {}), 1)
        rows.append(
            target_row("cold compile s per step shape", TARGETS["cold_s_per_shape"], per_shape, where, at_most=True)
        )
        warm = c.get("warm_s") / c["cold_s"] if c.get("warm_s") is not None else None
        rows.append(target_row("warm start / cold compile", TARGETS["warm_over_cold"], warm, where, at_most=True))
    return rows


def machine_info(device) -> dict:
    import torch

    versions = package_versions(("torch", "lightning-thunder", "litgpt", "thunder_batch", "tokenizers", "litserve"))
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        (int(line.split()[1]) * 1024 for line in _read("/proc/meminfo").splitlines() if line.startswith("MemTotal")),
        None,
    )
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None
    from thunder_batch.compile.project_executor import linear_kernels

    return dict(
        linear_kernels=None if gpu else linear_kernels(),
        versions=versions,
        python=sys.version.split()[0],
        platform=platform.platform(),
        cpu=cpu,
        cpu_count=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        memory_bytes=mem,
        gpu=gpu,
        device=str(device),
        loadavg=os.getloadavg(),
    )


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
