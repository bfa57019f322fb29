"""What a verify step (speculative decoding) costs against a plain decode step: median wall time of each
kind, and one profiled step of each split as `step_kernels.py` splits it (linears, attention, KV writes,
fused regions, other ops, host) with its kernel count. The default model, Thunder with the default
executors, B slots each copying a passage from `data/grounded.jsonl` greedily (drafts stand, so the
gate keeps checking them); steps that feed prompt tokens are left out.

    python benchmarks/verify_step.py --batch-size 1 --speculative-tokens 4 --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from step_kernels import count_kernels, split_step

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.bench.workloads import load_prompts


def copy_prompts(batch_size: int) -> list:
    texts = [t for t in load_prompts("grounded") if "word for word" in t or "exactly" in t]
    return [[dict(role="user", content=texts[i % len(texts)])] for i in range(batch_size)]


def one_step(engine, profiled: bool) -> tuple[str, float, object]:
    """(kind, seconds, profile or None) of the engine's next step; kind "prompt" when it feeds prompt tokens."""
    from torch.profiler import profile

    scheduler = engine.scheduler
    decode = not scheduler.waiting and all(r is None or len(r.pending_ids()) == 1 for r in scheduler.slots)
    before = engine.stats()["speculative"]["verify_steps"]
    with profile() if profiled else contextlib.nullcontext() as prof:
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
    kind = "verify" if engine.stats()["speculative"]["verify_steps"] > before else "plain"
    return (kind if decode else "prompt"), seconds, prof


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--reps", type=int, default=3, help="timed passes over the prompts; one more is profiled")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch._inductor.config.cpp.enable_kernel_profile = True
    config = EngineConfig(
        batch_size=args.batch_size,
        max_seq_length=512,
        speculative_tokens=args.speculative_tokens,
        cache_dir=args.cache_dir,
    )
    engine = Engine.from_checkpoint(config=config)
    engine.warmup()
    times, splits = {"plain": [], "verify": []}, {"plain": [], "verify": []}
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0)
    for rep in range(args.reps + 1):
        for prompt in copy_prompts(args.batch_size):
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            kind, seconds, prof = one_step(engine, profiled=rep == args.reps)
            if kind in times and prof is None:
                times[kind].append(seconds)
            elif kind in times:
                splits[kind].append((split_step(prof.events(), seconds), count_kernels(prof.events())[0]))
    for kind in times:
        median = 1e3 * statistics.median(times[kind]) if times[kind] else float("nan")
        split, kernels = splits[kind][len(splits[kind]) // 2] if splits[kind] else ({}, 0)
        print(f"{kind}: {len(times[kind])} steps, median {median:.2f} ms; profiled: {kernels} kernels, {split}")


if __name__ == "__main__":
    main()
