"""Cold compile of the layered step program against model depth, and what the tracing speedups save.

    python benchmarks/trace_cost.py --layers 8,30,60 --chunk 16
    python benchmarks/trace_cost.py --layers 30 --speedups both     # trace_speedups on vs off

Each row runs in a fresh process: the default model's architecture (SmolLM2-135M-Instruct, random
weights) cut or extended to N layers, B=8, max_seq_length 256, no compile cache, and times
`Engine.warmup()`, which makes every piece of every step shape (prefix, block programs, both heads).
Prints one JSON line per row: seconds per step shape (decode only; 2 prefill lanes of `--chunk` beside
the decode rows), pieces traced, programs per piece.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")  # the unwritable cache dir is on purpose: nothing is stored
import litgpt, torch
from thunder_batch import Engine, EngineConfig

n_layer, chunk, batch = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = litgpt.Config.from_name("SmolLM2-135M-Instruct", n_layer=n_layer)
config = EngineConfig(batch_size=batch, max_seq_length=256, prefill_chunk=chunk, cache_dir="/dev/null/none")
engine = Engine(litgpt.GPT(cfg).eval(), config)
per_shape = engine.warmup()
stats = engine.stats()
print(json.dumps(dict(n_layer=n_layer, batch_size=batch, per_shape_s={w: round(s, 2) for w, s in per_shape.items()},
                      traced=stats["traced"], programs=stats["programs"],
                      seconds_by_piece=stats["compile_seconds_by_piece"])))
"""


def run_row(n_layer: int, chunk: int, batch: int, speedups: bool) -> dict:
    env = dict(os.environ, THUNDER_BATCH_FAST_TRACE="1" if speedups else "0")
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(n_layer), str(chunk), str(batch)], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), trace_speedups=speedups)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", default="8,30,60")
    parser.add_argument("--chunk", type=int, default=16, help="prefill chunk C (tokens per lane)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--speedups", choices=["on", "off", "both"], default="on")
    args = parser.parse_args()
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.speedups]
    for n_layer in [int(n) for n in args.layers.split(",")]:
        for speedups in modes:
            print(json.dumps(run_row(n_layer, args.chunk, args.batch_size, speedups)), flush=True)


if __name__ == "__main__":
    main()
