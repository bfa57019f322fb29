"""The benchmark: the engine against litgpt's own loops and transformers, same prompts, same weights, one run.

Workloads live in `workloads`, litgpt's loops in `baselines`, transformers in `hf_transformers`, the engine
runs in `engine_runs` (all follow `system`); which (system, precision, B) runs are made in `plan`; numbers,
checks and targets in `report` (over `metrics`); the table and plot in `output`. This module runs it all
(`run_benchmark`) as its `options` (BenchOptions) say; the `thunder-batch bench` command
(thunder_batch/cli/bench.py) loads the model and calls it.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from thunder_batch.bench.options import BenchOptions
from thunder_batch.bench.run_plan import (
    ALL_SYSTEMS,
    parse_batch_sizes,
    parse_precisions,
    parse_systems,
    plan_runs,
)

__all__ = ["ALL_SYSTEMS", "parse_batch_sizes", "parse_precisions", "parse_systems", "run_benchmark"]


def unavailable_systems(systems: list[str], options: BenchOptions) -> dict[str, str]:
    """system -> why it cannot run here (missing executor, package or build, or offline-only peer in an online run)."""
    from thunder_batch.bench import llama_cpp
    from thunder_batch.bench.engine_runs import ENGINE_SYSTEMS
    from thunder_batch.bench.hf_transformers import HF_SYSTEMS
    from thunder_batch.bench.hf_transformers import unavailable as hf_unavailable

    skipped = {}
    if llama_cpp.SYSTEM in systems:
        why = llama_cpp.unavailable(options.llama_cpp_bin, options.llama_cpp_gguf)
        if why:
            skipped[llama_cpp.SYSTEM] = why
    if options.online and "litgpt-batched" in systems:
        skipped["litgpt-batched"] = "batched_generate_fn has no arrivals: offline workloads only"
    for s in [s for s in systems if s in HF_SYSTEMS]:
        why = "static batches have no arrivals: offline workloads only" if options.online else hf_unavailable()
        if why:
            skipped[s] = why
    thunder = [s for s in systems if s.startswith("thunder-")]
    if thunder:
        from thunder_batch.compile.executors import executor_availability

        availability = executor_availability()
        for s in thunder:
            missing = [f"{n}: {availability[n]}" for n in ENGINE_SYSTEMS[s] if availability.get(n)]
            if missing:
                skipped[s] = "unavailable: " + "; ".join(missing)
    return skipped


def run_system(name: str, gpt, workload, batch_size: int | None, ctx):
    """One system on the workload (module-level so tests can wrap it)."""
    from thunder_batch.bench import baselines, engine_runs, hf_transformers, llama_cpp

    if name == llama_cpp.SYSTEM:
        return llama_cpp.run_llama_cpp(workload, batch_size, ctx, ctx.llama_cpp_files[precision_of(gpt)])
    if name == "litgpt-sequential":
        return baselines.run_litgpt_sequential(gpt, workload, ctx)
    if name == "litgpt-batched":
        return baselines.run_litgpt_batched(gpt, workload, batch_size, ctx)
    if name in hf_transformers.HF_SYSTEMS:
        return hf_transformers.run_transformers(gpt, workload, name, batch_size, ctx)
    return engine_runs.run_engine(gpt, workload, name, batch_size, ctx)


def make_workload(gpt, tokenizer, prompt_style, options: BenchOptions):
    from thunder_batch.bench.workloads import build_workload, fitted_max_seq_length
    from thunder_batch.chat import apply_chat

    def encode(text: str) -> list[int]:
        return tokenizer.encode(apply_chat(prompt_style, [dict(role="user", content=text)])).tolist()

    limit = options.max_seq_length or gpt.config.block_size
    workload = build_workload(
        options.dataset,
        options.num_requests,
        options.max_new_tokens,
        seed=options.seed,
        input_len=options.input_len,
        range_ratio=options.range_ratio,
        request_rate=options.request_rate,
        vocab_size=gpt.config.padded_vocab_size,
        encode=None if tokenizer is None else encode,
        max_seq_length=limit,
    )
    max_seq_length = options.max_seq_length or min(fitted_max_seq_length(workload), gpt.config.block_size)
    return workload, max_seq_length


def run_benchmark(gpt, tokenizer=None, prompt_style=None, *, options: BenchOptions, model_label: str = "model") -> dict:
    """Run the benchmark on a loaded litgpt GPT (tokenizer may be None with dataset="random"), on the
    model's device; returns the result dict that --output-json writes. The model's label gets the run's
    precisions appended."""
    from thunder_batch.bench.metrics import measure_peaks
    from thunder_batch.bench.system_run import BenchContext

    precisions = parse_precisions(options.precisions, precision_of(gpt))
    specs = parse_systems(options.systems)
    plan = plan_runs(specs, precisions, parse_batch_sizes(options.batch_size))
    models = converted_models(gpt, precisions)
    workload, max_seq_length = make_workload(gpt, tokenizer, prompt_style, options)
    ctx = BenchContext.from_options(gpt, tokenizer, options, max_seq_length)
    skipped = unavailable_systems([s.name for s in specs], options)
    plan = [p for p in plan if p[0] not in skipped]
    peaks = measure_peaks(ctx.device, precisions, options.matmul_n, options.copy_mb)
    model_label = f"{model_label} {','.join(precisions)}"
    started = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="thunder-batch-gguf-") as folder:  # GGUFs written for llama.cpp
        ctx.llama_cpp_files = llama_cpp_files(plan, models, options, Path(folder), skipped)
        for name, precision, B in plan:
            if name == "llama.cpp" and precision not in ctx.llama_cpp_files:
                continue
            runs.append(run_system(name, models[precision], workload, B, ctx))
            runs[-1].precision = precision
            if options.output_json:  # partial results survive an interrupted run
                write_result(runs, models, workload, ctx, options, peaks, skipped, model_label, started)
    result = write_result(runs, models, workload, ctx, options, peaks, skipped, model_label, started)
    emit(result, options)
    return result


def llama_cpp_files(plan, models: dict, options: BenchOptions, folder: Path, skipped: dict) -> dict[str, str]:
    """precision -> the GGUF llama.cpp runs beside that precision's model (bench.llama_cpp_files); a precision whose
    model cannot be written is noted in `skipped`, not run."""
    from thunder_batch.bench import llama_cpp
    from thunder_batch.bench.llama_cpp_files import LlamaCppFiles

    precisions = list(dict.fromkeys(precision for name, precision, _ in plan if name == llama_cpp.SYSTEM))
    files = LlamaCppFiles(options.llama_cpp_gguf, folder) if precisions else None
    chosen = {}
    for precision in precisions:
        try:
            chosen[precision] = files.for_model(models[precision])
        except ValueError as e:
            skipped[f"{llama_cpp.SYSTEM}@{precision}"] = f"no GGUF of this model: {e}"
    return chosen


def precision_of(gpt) -> str:
    return str(gpt.transformer.wte.weight.dtype).removeprefix("torch.")


def converted_models(gpt, precisions: list[str]) -> dict:
    """precision -> the loaded model in it: `gpt` itself for its own dtype, else a converted copy."""
    import copy

    import torch

    return {p: gpt if p == precision_of(gpt) else copy.deepcopy(gpt).to(getattr(torch, p)) for p in precisions}


def write_result(runs, models, workload, ctx, options: BenchOptions, peaks, skipped, model_label, started) -> dict:
    from thunder_batch.bench.report import machine_info, write_json

    result = assemble(runs, models, workload, ctx, options, peaks, skipped, model_label)
    result["meta"] = dict(
        machine_info(ctx.device), started_unix=started, duration_s=time.time() - started, command=" ".join(sys.argv)
    )
    if options.output_json:
        write_json(result, options.output_json)
    return result


def assemble(runs, models: dict, workload, ctx, options: BenchOptions, peaks, skipped, model_label) -> dict:
    from thunder_batch.bench import report
    from thunder_batch.bench.metrics import ModelCost

    costs = {p: ModelCost.of(gpt) for p, gpt in models.items()}
    # K and V of one cache entry in every layer: a step reads L of them per slot (L its ladder rung).
    element = {p: gpt.transformer.wte.weight.element_size() for p, gpt in models.items()}
    kv_bytes = {p: 2 * c.n_layer * c.kv_width * element[p] for p, c in costs.items()}
    metrics = [report.run_metrics(r, costs[r.precision], peaks, kv_bytes[r.precision]) for r in runs]
    reference = report.check_all(runs, metrics)
    table, baseline = report.speedups(metrics)
    cost = next(iter(costs.values()))  # parameter counts do not depend on the precision
    return dict(
        workload=workload_info(workload, ctx, options, model_label),
        options={k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(options).items()},
        peaks=peaks,
        model=dict(
            label=model_label,
            precisions=list(models),
            block_linear_params=cost.block_linear_params,
            lm_head_params=cost.lm_head_params,
            weight_bytes={p: c.weight_bytes for p, c in costs.items()},
        ),
        runs=metrics,
        token_reference=reference,
        speedup_vs_litgpt_sequential=table,
        litgpt_sequential_baseline=baseline,
        targets=report.targets(metrics, equal_outputs=equal_outputs(workload, ctx)),
        skipped=skipped,
    )


def workload_info(workload, ctx, options: BenchOptions, model_label: str) -> dict:
    """The result's description of the workload and the engine shape it ran with."""
    from thunder_batch.bench.workloads import describe

    mode = f"online {options.request_rate} req/s" if options.online else "offline"
    return dict(
        describe(workload),
        label=f"{model_label}, {options.dataset}, {len(workload)} requests, {mode}",
        dataset=options.dataset,
        mode=mode,
        max_seq_length=ctx.max_seq_length,
        prefill_chunk=ctx.prefill_chunk,
        prefill_lanes=ctx.prefill_lanes,
        max_prefill_lanes=ctx.max_prefill_lanes,
        attention_lengths=ctx.attention_lengths,
        ignore_eos=ctx.ignore_eos,
        seed=options.seed,
    )


def equal_outputs(workload, ctx) -> bool:
    """Every request makes exactly the same number of tokens (EOS ignored, one limit for all)."""
    return ctx.ignore_eos and len({r.max_new_tokens for r in workload}) == 1


def emit(result: dict, options: BenchOptions) -> None:
    from thunder_batch.bench.output import plot, print_report

    print_report(result)
    if options.output_json:
        print(f"wrote {options.output_json}", file=sys.stderr)
    if options.plot:
        plot(result, options.plot)
        print(f"wrote {options.plot}", file=sys.stderr)
