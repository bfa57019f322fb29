"""What one decode step costs, per compile mode: step time, kernels launched, time and bandwidth of
the linear layers. The default model (or random weights of its architecture), B decode rows.

Kernels per step are profiler events: top-level aten calls (an aten op called by another one is part
of it), the project's own kernels, and Inductor's generated kernels (its kernel profiling switched
on). Linear time: the self time of the linear kernels (aten addmm/mm, oneDNN, the project's packed linears);
weight bytes / linear time is the bandwidth the matmuls reach (not shown where layers run as one op, whose
linears the profiler does not see). The profiled step is also split into one-op blocks, linears,
attention, KV writes, fused regions, other ops and host time (outside every op).

    python benchmarks/step_kernels.py --batch-sizes 1,8 --precisions bfloat16,float32 \
        --systems eager,thunder-torch,thunder-default --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter

import torch

SYSTEMS = {  # name -> (compile, executors)
    "eager": ("eager", None),
    "thunder-torch": ("thunder", ("torch",)),
    "thunder-default": ("thunder", None),
    "thunder-torchcompile": ("thunder", ("torchcompile", "torch")),
    "thunder-kernels": ("thunder", ("thunder_batch", "torch")),
    "thunder-kernels-torchcompile": ("thunder", ("thunder_batch", "torchcompile", "torch")),
    "thunder-inductor": ("thunder", ("thunder_batch", "sdpa", "inductor", "torch")),
}
LINEAR_OPS = (
    "aten::addmm",
    "aten::mm",
    "mkldnn::_linear_pointwise",
    "thunder_batch::packed_linear",
    "thunder_batch::packed_linear_bf16",
)


def load_model(dtype, random_weights: bool):
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

    if random_weights:
        import litgpt

        from thunder_batch.bench.parity import random_weights as fill

        gpt = litgpt.GPT(litgpt.Config.from_name("SmolLM2-135M-Instruct"))
        fill(gpt)
        return gpt.to(dtype).eval()
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=dtype)
    return gpt


def decode_engine(gpt, system: str, batch_size: int, max_seq_length: int, cache_dir: str | None):
    from thunder_batch import Engine, EngineConfig, SamplingParams

    mode, executors = SYSTEMS[system]
    config = EngineConfig(
        batch_size=batch_size,
        max_seq_length=max_seq_length,
        prefill_chunk=16,
        attention_lengths=(max_seq_length,),
        compile=mode,
        executors=executors,
        cache_dir=cache_dir,
    )
    engine = Engine(gpt, config)
    prompts = [[1 + (7 * i + j) % 500 for j in range(8)] for i in range(batch_size)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # compile, fill the slots
    for p in prompts:  # keep every slot decoding for the timed steps
        engine.add_request(p, SamplingParams(max_new_tokens=max_seq_length - 16, ignore_eos=True))
    while any(r is None or r.num_cached < len(r.prompt_ids) for r in engine.scheduler.slots):
        engine.step()
    return engine


SPLIT = {  # part of the step -> profiler event names (substrings) of its top-level ops
    # a decode-only step's llama-shaped layer as one op (compile.block_op): its linears and attention inside
    "blocks": ("thunder_batch::decode_block", "thunder_batch::decode_stack"),
    "linears": (*LINEAR_OPS, "aten::linear"),
    # thunder_batch::decode_attention; decode_rows_attention (a decode-only step's) and slot_rows_attention
    # (a verify step's), with their KV writes
    "attention": ("scaled_dot_product_attention", "thunder_batch::decode_", "thunder_batch::slot_rows_"),
    "kv_write": ("aten::index_copy_", "aten::copy_"),
    "fused": ("CompiledFxGraph", "AOTDispatcher"),
}


def split_step(events, wall_s: float) -> dict:
    """ms of one profiled step per part: SPLIT's, `other_ops` (views, the head's ops) and `host` (the
    wall time outside every top-level op: Python, Thunder's trace, dispatch between ops)."""
    parts = dict.fromkeys([*SPLIT, "other_ops"], 0.0)
    for e in (e for e in events if e.cpu_parent is None):
        part = next((p for p, names in SPLIT.items() if any(n in e.name for n in names)), "other_ops")
        parts[part] += e.cpu_time_total / 1e3
    parts["host"] = 1e3 * wall_s - sum(parts.values())
    return {p: round(ms, 2) for p, ms in parts.items()}


def count_kernels(events) -> tuple[int, float, Counter]:
    """(kernels, linear self-time in seconds, calls per name) of one profiled step: every top-level
    event (an aten op, one of the project's ops, an Inductor kernel) is one launch."""
    calls, linear_us = Counter(), 0.0
    for e in events:
        if e.cpu_parent is None:
            calls[e.name] += 1
        if any(op in e.name for op in LINEAR_OPS):
            linear_us += e.self_cpu_time_total
    return sum(calls.values()), linear_us / 1e6, calls


def measure(engine, steps: int) -> dict:
    from torch.profiler import profile

    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    torch._inductor.config.cpp.enable_kernel_profile = True
    with profile() as prof:
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
    kernels, linear_s, calls = count_kernels(prof.events())
    split = split_step(prof.events(), wall)
    return dict(
        step_ms=1e3 * statistics.median(times), kernels=kernels, linear_ms=1e3 * linear_s, top=calls, split=split
    )


def linear_weight_bytes(gpt) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in gpt.modules() if isinstance(m, torch.nn.Linear))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--precisions", default="bfloat16,float32")
    ap.add_argument("--systems", default="eager,thunder-torch,thunder-default")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-seq-length", type=int, default=256)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    rows = []
    for precision in args.precisions.split(","):
        gpt = load_model(getattr(torch, precision), args.random_weights)
        weight_bytes = linear_weight_bytes(gpt)
        for B in map(int, args.batch_sizes.split(",")):
            for system in args.systems.split(","):
                engine = decode_engine(gpt, system, B, args.max_seq_length, args.cache_dir)
                r = measure(engine, args.steps)
                r.update(system=system, precision=precision, batch_size=B)
                one_op = r["split"]["blocks"] > 0  # the layers' linears run inside the block op
                r["linear_gb_s"] = None if one_op else weight_bytes / 1e9 / max(r["linear_ms"] / 1e3, 1e-9)
                rows.append(r)
                top = ", ".join(f"{n} {c}" for n, c in r["top"].most_common(6))
                rate = B / r["step_ms"] * 1e3
                bandwidth = "in the block op" if one_op else f"{r['linear_gb_s']:4.1f} GB/s"
                print(
                    f"{precision:9} B={B:<3} {system:28} step {r['step_ms']:7.1f} ms  tok/s {rate:6.1f}  kernels "
                    f"{r['kernels']:5}  linear {r['linear_ms']:6.1f} ms ({bandwidth})  [{top}]",
                    flush=True,
                )
                print(
                    f"{'':9} profiled step, ms: " + ", ".join(f"{p} {ms}" for p, ms in r["split"].items()), flush=True
                )
                del engine
    base = {(r["precision"], r["batch_size"]): r["step_ms"] for r in rows if r["system"] == "eager"}
    for r in rows:
        if (r["precision"], r["batch_size"]) in base:
            r["vs_eager"] = base[r["precision"], r["batch_size"]] / r["step_ms"]
            print(f"{r['precision']:9} B={r['batch_size']:<3} {r['system']:28} vs eager {r['vs_eager']:.2f}x")
    if args.output_json:
        for r in rows:
            r["top"] = dict(r["top"].most_common(20))
        with open(args.output_json, "w") as f:
            json.dump(dict(rows=rows, argv=sys.argv), f, indent=1)


if __name__ == "__main__":
    main()
