"""The GPU check's bf16 benchmark: time per decode step of eager, Thunder and Thunder + CUDA graphs at
each batch size, with the share of HBM bandwidth the step reaches, and Hugging Face transformers (static
cache; eager and generate's torch.compile) as a peer where it is importable.

Every engine step is a decode step here (prefill_chunk=1: prompts go in one token per step through the
decode rows), so one step shape per batch size, and bytes per step are the weights once plus the K and V
entries attention reads (the ladder rung: max_seq_length)."""

from __future__ import annotations

import copy
import os
import time

import torch

from thunder_batch import Engine, EngineConfig, SamplingParams

from gpu_check_stages import MODES, prompts_of

SIZES = {"cuda": (16, 64), "cpu": (8, 8)}  # prompt tokens, new tokens per request
# Peak HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name() (vendor datasheets);
# GPU_CHECK_HBM_GBPS overrides it.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}


def peak_bandwidth(device: str) -> float | None:
    if os.environ.get("GPU_CHECK_HBM_GBPS"):
        return float(os.environ["GPU_CHECK_HBM_GBPS"]) * 1e9
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def decode_bytes(gpt, batch: int, length: int) -> int:
    """Bytes a decode step of `batch` rows must read: every weight once, K and V of `length` entries per row."""
    c = gpt.config
    weights = sum(p.numel() * p.element_size() for p in gpt.parameters())
    kv = c.n_layer * 2 * batch * c.n_query_groups * c.head_size * length * gpt.lm_head.weight.element_size()
    return weights + kv


def timed_generate(engine: Engine, prompts, new: int) -> tuple[float, int]:
    """(best seconds of two full runs, engine steps of one): the first may still pay lazy setup."""
    params, best, steps = SamplingParams(max_new_tokens=new, ignore_eos=True), float("inf"), 0
    for _ in range(2):
        before = engine.stats()["steps"]
        _sync()
        start = time.perf_counter()
        engine.generate(prompts, params)
        _sync()
        best, steps = min(best, time.perf_counter() - start), engine.stats()["steps"] - before
    return best, steps


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_engine(gpt_bf16, mode: str, batch: int, prompt_len: int, new: int) -> dict:
    shape = dict(batch_size=batch, max_seq_length=prompt_len + new, prefill_chunk=1)
    engine = Engine(gpt_bf16, EngineConfig(**MODES[mode], **shape))
    compile_s = sum(engine.warmup().values())
    prompts = prompts_of([prompt_len] * batch, gpt_bf16.config.vocab_size, seed=batch)
    seconds, steps = timed_generate(engine, prompts, new)
    stats = engine.stats()
    row = dict(mode=mode, batch_size=batch, compile_s=round(compile_s, 2), seconds=round(seconds, 4), steps=steps)
    row.update(ms_per_step=round(1000 * seconds / steps, 3), tokens_per_s=round(batch * new / seconds, 1))
    row["bytes_per_step"] = decode_bytes(gpt_bf16, batch, shape["max_seq_length"])
    for key in ("cache_misses", "traced", "disk_cache_hits", "trace_speedups", "cuda_graphs"):
        if key in stats and mode != "eager":
            row[key] = stats[key]
    return row


def bench_transformers(gpt_bf16, system: str, batch: int, prompt_len: int, new: int) -> dict:
    """One static batch through transformers' generate (static cache): seconds per generated position."""
    from thunder_batch.bench.hf_transformers import run_transformers
    from thunder_batch.bench.system_run import BenchContext
    from thunder_batch.bench.workloads import BenchRequest

    prompts = prompts_of([prompt_len] * batch, gpt_bf16.config.vocab_size, seed=batch)
    workload = [BenchRequest(i, tuple(p), new) for i, p in enumerate(prompts)]
    device = gpt_bf16.lm_head.weight.device
    ctx = BenchContext(device=device, max_seq_length=prompt_len + new, ignore_eos=True, progress=False)
    run = run_transformers(gpt_bf16, workload, system, batch, ctx)
    compile_s = run.compile.get("cold_s", run.compile.get("first_step_s", 0.0))
    row = dict(mode=system, batch_size=batch, compile_s=round(compile_s, 2), seconds=round(run.wall_s, 4), steps=new)
    row.update(ms_per_step=round(1000 * run.wall_s / new, 3), tokens_per_s=round(batch * new / run.wall_s, 1))
    row["bytes_per_step"] = decode_bytes(gpt_bf16, batch, prompt_len + new)
    return row


def run_benchmark(report, gpt, device: str, batches: list[int], modes: list[str]) -> None:
    from thunder_batch.bench.hf_transformers import unavailable

    prompt_len, new = SIZES[device]
    section = report.data.setdefault("benchmark", dict(dtype="bfloat16", prompt_tokens=prompt_len, new_tokens=new))
    section.update(rows=[], peak_bandwidth_bytes_per_s=peak_bandwidth(device))
    hf_missing = unavailable()
    section["transformers"] = hf_missing or "available"
    peers = [] if hf_missing else ["hf-transformers"] + (["hf-transformers-compile"] if device == "cuda" else [])
    if device != "cuda":
        report.needs_cuda("benchmark: thunder-cudagraphs (CPU dry run: eager, thunder, hf-transformers eager)")
    gpt_bf16 = copy.deepcopy(gpt).to(torch.bfloat16)
    for batch in batches:
        for mode in ["eager", *modes, *peers]:
            # A traced mode needs one shape at the measured rate; torch.compile of transformers about a minute.
            need = report.compile_estimate(1) if mode.startswith("thunder") else 60 * mode.endswith("-compile")
            if not report.has_time(need + 15, f"benchmark {mode} batch {batch}"):
                continue
            with report.stage(f"benchmark: {mode}, batch {batch}"):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                run = bench_transformers if mode.startswith("hf-") else bench_engine
                row = run(copy.deepcopy(gpt_bf16), mode, batch, prompt_len, new)
                if mode == "thunder":
                    report.observe_compile({"1": row["compile_s"]})
                bandwidth = section["peak_bandwidth_bytes_per_s"]
                row["hbm_share"] = (
                    round(row["bytes_per_step"] * 1000 / row["ms_per_step"] / bandwidth, 4) if (bandwidth) else None
                )
                if device == "cuda":
                    row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                section["rows"].append(row)
