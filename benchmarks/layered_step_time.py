"""Decode step time: the layered program (pieces, shared block traces) vs the whole-step trace.

    python benchmarks/layered_step_time.py --batch-sizes 8,32 --rounds 5 --steps 10

Default model architecture (30 layers, random weights), max_seq_length 256, decode-only steps,
torch executor defaults. For each B both programs are compiled (the whole-step trace takes minutes
per B on a small CPU), then timed in alternating rounds of `--steps` decode steps (all slots busy:
a step costs the same whatever the occupancy, which is data). Prints median ms per step and the
ratio layered / whole (below 1: the layered program is faster). Outputs are compared too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings


def build(gpt_config, batch_size: int, trace: str):
    import litgpt
    import torch

    from thunder_batch import Engine, EngineConfig

    torch.manual_seed(0)
    config = EngineConfig(
        batch_size=batch_size, max_seq_length=256, prefill_chunk=1, trace=trace, cache_dir="/dev/null/none"
    )
    engine = Engine(litgpt.GPT(gpt_config).eval(), config)
    start = time.perf_counter()
    with torch.no_grad():
        engine.runner.step_fn(*decode_args(engine), head="greedy")  # compiles the program timed below
    return engine, time.perf_counter() - start


def decode_args(engine):
    """A decode-only step with every slot at position ~200 (greedy, no filter)."""
    import torch

    args = list(engine.runner.inputs_for(_empty_plan()))
    B = args[0].shape[0]
    args[0] = torch.randint(0, 1000, (B,))
    args[1] = torch.full((B,), 200) - torch.arange(B)
    return args


def _empty_plan():
    from thunder_batch.step_plan import StepPlan

    return StepPlan([])


def median_step_seconds(engine, args, steps: int) -> float:
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(steps):
            out = engine.runner.step_fn(*args, head="greedy")
        out[0].tolist()
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    import litgpt

    warnings.simplefilter("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    cfg = litgpt.Config.from_name("SmolLM2-135M-Instruct")
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        engines = {trace: build(cfg, batch_size, trace) for trace in ("layers", "step")}
        step_args = decode_args(engines["layers"][0])
        same = [engines[t][0].runner.step_fn(*step_args, head="greedy")[0].tolist() for t in engines]
        times = {trace: [] for trace in engines}
        for _ in range(args.rounds):
            for trace, (engine, _) in engines.items():
                times[trace].append(median_step_seconds(engine, step_args, args.steps))
        median = {trace: statistics.median(ms) for trace, ms in times.items()}
        print(
            json.dumps(
                dict(
                    batch_size=batch_size,
                    compile_s={t: round(e[1], 1) for t, e in engines.items()},
                    median_step_ms={t: round(m, 1) for t, m in median.items()},
                    layered_over_whole=round(median["layers"] / median["step"], 3),
                    same_tokens=same[0] == same[1],
                    rounds_ms=times,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
