"""Cost of one step by width T and batch B (default model, eager, all slots padding: a full step's work).

    python benchmarks/step_widths.py --batch-sizes 8,32 --widths 1,4,8,16,32,64

A step computes all B x T positions whatever the occupancy (fixed shapes), so this table is what a
prefill chunk size costs the decoding slots that ride along in the same step. Prints one JSON line
per (B, T): the fastest of three runs after one warm-up, and the cost per computed position.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--widths", default="1,4,8,16,32,64")
    parser.add_argument("--max-seq-length", type=int, default=256)
    args = parser.parse_args()
    from thunder_batch import Engine, EngineConfig
    from thunder_batch.scheduler import StepPlan

    widths = [int(w) for w in args.widths.split(",")]
    for B in (int(b) for b in args.batch_sizes.split(",")):
        config = EngineConfig(
            batch_size=B, max_seq_length=args.max_seq_length, prefill_chunk=max(widths), compile="eager"
        )
        run = Engine.from_checkpoint(None, config).runner.run
        for T in widths:
            plan = StepPlan(T, [])
            run(plan)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                run(plan)
                times.append(time.perf_counter() - start)
            best = min(times)
            print(
                json.dumps(
                    dict(
                        batch_size=B,
                        width=T,
                        step_ms=round(1000 * best, 1),
                        ms_per_position=round(1000 * best / (B * T), 2),
                    )
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
