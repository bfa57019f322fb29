"""Cost of one step by shape: decode-only vs with P prefill lanes of C tokens, at attention length L.

    python benchmarks/step_shapes.py --batch-sizes 8,32 --lanes 1,2,4 --chunks 16,64 --lengths 256,1024

Default model, all slots padding (a step's cost does not depend on occupancy: fixed shapes), eager
unless `--compile thunder`. For each B and L, times the decode-only step, then each (P, C) mixed step,
and prints one JSON line per shape: best of `--reps` after one warm-up, and the ratio to the
decode-only step at the same B and L (what admitting prompts costs the decoding slots).
"""

from __future__ import annotations

import argparse
import json
import time


def step_ms(runner, shape, reps: int) -> float:
    """Best of `reps` padding-only steps of this shape (greedy head), after one warm-up."""
    from thunder_batch.step_plan import StepPlan

    best = float("inf")
    for i in range(reps + 1):
        start = time.perf_counter()
        runner.run(StepPlan([]), "greedy", shape)
        best = min(best, time.perf_counter() - start) if i else best
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--lanes", default="1,2,4")
    parser.add_argument("--chunks", default="16,64")
    parser.add_argument("--lengths", default="256", help="attention lengths L (each <= --max-seq-length)")
    parser.add_argument("--max-seq-length", type=int, default=1024)
    parser.add_argument("--compile", default="eager", choices=("eager", "thunder"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    import torch

    from thunder_batch import Engine, EngineConfig
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint
    from thunder_batch.config import StepShape

    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=torch.float32)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    lengths = ints(args.lengths)
    for B in ints(args.batch_sizes):
        for P in [p for p in ints(args.lanes) if p <= B]:
            for C in ints(args.chunks):
                config = EngineConfig(
                    batch_size=B,
                    max_seq_length=args.max_seq_length,
                    prefill_chunk=C,
                    prefill_lanes=P,
                    attention_lengths=lengths,
                    compile=args.compile,
                    cache_dir="/dev/null/none",
                )
                runner = Engine(gpt, config).runner
                for L in lengths:
                    ms = {lanes: step_ms(runner, StepShape(lanes, L), args.reps) for lanes in (0, P)}
                    row = dict(batch_size=B, lanes=P, chunk=C, length=L, rows=config.step_rows(P))
                    row.update(
                        decode_ms=round(ms[0], 1), mixed_ms=round(ms[P], 1), mixed_vs_decode=round(ms[P] / ms[0], 2)
                    )
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
