"""Copying a prompt prefix between slots vs computing it: where copying starts to pay.

The copy (`Runner.copy_prefixes`) moves n cache entries of every layer's K and V from one slot to
another on the host side, between steps. Computing the same n tokens costs their share of a prefill
step: (a step with P lanes of C prompt tokens - a decode-only step) / (P * C), both at the same rung.
Prints a JSON line per n and the smallest n where the copy is cheaper; eager, the default model.

    python benchmarks/prefix_copy.py --precision float32 --batch_size 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from thunder_batch import Engine, EngineConfig
from thunder_batch.config import StepShape
from thunder_batch.step_plan import PrefixCopy, StepPlan


def median_seconds(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    config = EngineConfig(batch_size=args.batch_size, max_seq_length=1024, compile="eager")
    engine = Engine.from_checkpoint(config=config, dtype=getattr(torch, args.precision))
    runner, rung = engine.runner, config.ladder[0]
    lanes = config.lane_counts[0]
    with torch.no_grad():
        decode = median_seconds(lambda: runner.run(StepPlan([]), "greedy", StepShape(0, rung)), args.reps)
        prefill = median_seconds(lambda: runner.run(StepPlan([]), "greedy", StepShape(lanes, rung)), args.reps)
    per_token = (prefill - decode) / (lanes * config.prefill_chunk)
    print(json.dumps(dict(decode_step_ms=1e3 * decode, prefill_step_ms=1e3 * prefill, per_token_ms=1e3 * per_token)))
    first_paying = None
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        copy = median_seconds(lambda n=n: runner.copy_prefixes([PrefixCopy(0, 1, 0, n)]), args.reps)
        compute = n * per_token
        print(json.dumps(dict(tokens=n, copy_ms=1e3 * copy, compute_ms=1e3 * compute, ratio=compute / copy)))
        if first_paying is None and copy < compute:
            first_paying = n
    print(json.dumps(dict(copy_cheaper_from_tokens=first_paying)))


if __name__ == "__main__":
    main()
