"""Where a cold trace's time goes: Thunder's bytecode interpreter vs its transforms, per layer count.

    python benchmarks/trace_cost.py --layers 1,2,4,8 --width 1

Traces the default model's architecture (SmolLM2-135M-Instruct, random weights) cut to N layers, B=8,
one step width, through the engine's own compile path (tracing speedups on, no compile cache).
"Interpreter" is the time inside `thunder_general_jit` (running the step program's Python bytecode
into an initial trace); "transforms and rest" is everything else of the first call (transforms to an
execution trace, prologue, and running the step once). Prints one JSON line per layer count and the
fitted per-layer slope, then extrapolates to the full 30 layers.
"""

from __future__ import annotations

import argparse
import json
import time


def trace_once(n_layer: int, width: int) -> dict:
    import litgpt
    import torch

    from thunder_batch import Engine, EngineConfig
    from thunder_batch._compat import import_thunder
    from thunder_batch.scheduler import StepPlan

    thunder = import_thunder()
    spent = []
    original = thunder.thunder_general_jit

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    torch.manual_seed(0)
    cfg = litgpt.Config.from_name("SmolLM2-135M-Instruct", n_layer=n_layer)
    config = EngineConfig(batch_size=8, max_seq_length=256, prefill_chunk=max(width, 2), cache_dir="/dev/null/none")
    engine = Engine(litgpt.GPT(cfg).eval(), config)
    thunder.thunder_general_jit = timed
    try:
        start = time.perf_counter()
        engine.runner.run(StepPlan(width, []))
        total = time.perf_counter() - start
    finally:
        thunder.thunder_general_jit = original
    return dict(n_layer=n_layer, width=width, first_call_s=round(total, 2), interpreter_s=round(sum(spent), 2),
                transforms_and_rest_s=round(total - sum(spent), 2))


def main() -> None:
    import warnings

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="1,2,4,8")
    parser.add_argument("--width", type=int, default=1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the unwritable cache dir is on purpose: nothing is stored
    rows = [trace_once(int(n), args.width) for n in args.layers.split(",")]
    for row in rows:
        print(json.dumps(row))
    (a, b) = rows[0], rows[-1]
    slope = (b["first_call_s"] - a["first_call_s"]) / (b["n_layer"] - a["n_layer"])
    fixed = a["first_call_s"] - slope * a["n_layer"]
    print(json.dumps(dict(per_layer_s=round(slope, 2), fixed_s=round(fixed, 2),
                          extrapolated_30_layers_s=round(fixed + 30 * slope, 1))))


if __name__ == "__main__":
    main()
