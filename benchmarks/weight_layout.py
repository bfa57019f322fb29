"""Linears reading float32/bf16 weights in their own layout against packed copies beside them: speed and memory.

`kernels`: the project's `plain_linear` (the weight as it is, [out, in]) against `packed_linear(_bf16)` on a copy
packed once, over two layers of 1.7B-shaped weights (distinct, so nothing stays in cache), per row count.
`model`: a litgpt config with random weights (default SmolLM2-1.7B-Instruct), each layout in its own process
(packed copies forced by `FORCE_PACKED`), alternating rounds: decode ms per step at B=1 and B=8 (64 fresh prompt
tokens, 32 new, prefix reuse off), pp512 tok/s at B=1, and the process's peak RSS.

    python benchmarks/weight_layout.py kernels --dtype bfloat16 --rows 1,2,4,8,16,32,64,136
    python benchmarks/weight_layout.py model --precision bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
from linear_bandwidth import best  # benchmarks/linear_bandwidth.py: the fastest of `reps` runs after a warm one

MODEL_RUN = """
import json, os, random, resource, sys, time
import torch
from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import random_weights_model
if os.environ.get("FORCE_PACKED"):
    from thunder_batch.compile import project_executor
    project_executor.own_layout = lambda w: False
name, precision, batches = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split(",")]
model, tok, config, _ = random_weights_model(name, getattr(torch, precision))
rng = random.Random(0)
fresh = lambda n, length=64: [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]
def wall(engine, prompts, new):
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return time.perf_counter() - start
out = {}
for b in batches:
    engine = Engine(model, EngineConfig(batch_size=b, max_seq_length=128, prefix_reuse=False), tok)
    wall(engine, fresh(b), 32); wall(engine, fresh(b), 1)  # compiles every shape
    full = min(wall(engine, fresh(b), 32) for _ in range(2))
    first = min(wall(engine, fresh(b), 1) for _ in range(2))
    out[f"decode_ms_b{b}"] = round(1000 * (full - first) / 31, 1)
engine = Engine(model, EngineConfig(batch_size=1, max_seq_length=513, prefix_reuse=False), tok)
wall(engine, fresh(1, 512), 1)
out["pp512"] = round(512 / min(wall(engine, fresh(1, 512), 1) for _ in range(2)), 1)
out["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
print("RESULT " + json.dumps(out))
"""


def kernels(dtype: torch.dtype, rows_list: list[int]) -> None:
    from thunder_batch.native import build

    assert build.unavailable() is None, build.unavailable()
    torch.manual_seed(0)
    shapes = [(3 * 2048, 2048), (2048, 2048), (8192, 2048), (2048, 8192)] * 2  # qkv, proj, fc, mlp proj; 2 layers
    ws = [(torch.randn(o, i) * 0.02).to(dtype) for o, i in shapes]
    fp32 = dtype == torch.float32
    packed = [build.pack_linear_weight(w) if fp32 else build.pack_linear_weight_bf16(w) for w in ws]
    packed_op = build.packed_linear if fp32 else build.packed_linear_bf16
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    print("| rows | packed copy ms (GB/s) | own layout ms (GB/s) | own / packed time |")
    print("|---|---|---|---|")
    plain = torch.ops.thunder_batch.plain_linear
    for rows in rows_list:
        xs = {i: torch.randn(rows, i).to(dtype) for i in (2048, 8192)}
        packed_s = best(lambda xs=xs: [packed_op(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(ws, packed)], 5)
        own_s = best(lambda xs=xs: [plain(xs[w.shape[1]], w, None, w.shape[0]) for w in ws], 5)
        cells = [f"{1e3 * s:.1f} ({nbytes / s / 1e9:.1f})" for s in (packed_s, own_s)]
        print(f"| {rows} | {cells[0]} | {cells[1]} | {own_s / packed_s:.2f} |", flush=True)


def model(name: str, precision: str, batches: str, rounds: int) -> None:
    decode_cells = " | ".join(f"decode ms B={b}" for b in batches.split(","))
    print(f"| round | layout | {decode_cells} | pp512 tok/s | peak RSS GB |")
    print("|---|---|" + "---|" * (len(batches.split(",")) + 2))
    for r in range(rounds):
        for layout in ("own", "packed"):
            env = {**os.environ, "FORCE_PACKED": "1" if layout == "packed" else ""}
            args = [sys.executable, "-c", MODEL_RUN, name, precision, batches]
            text = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
            out = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
            decode = " | ".join(str(out[f"decode_ms_b{b}"]) for b in batches.split(","))
            print(f"| {r + 1} | {layout} | {decode} | {out['pp512']} | {out['peak_rss_gb']} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["kernels", "model"])
    parser.add_argument("--dtype", "--precision", dest="dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,136")
    parser.add_argument("--model", default="SmolLM2-1.7B-Instruct")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip(), flush=True)
    if args.what == "kernels":
        kernels(getattr(torch, args.dtype), [int(r) for r in args.rows.split(",")])
    else:
        model(args.model, args.dtype, args.batches, args.rounds)


if __name__ == "__main__":
    main()
