"""Decode-step linears of a 1-8B model on quantized weights: the native kernel per GGUF format against the float32
packed kernel and a plain read of memory, all in one run (ratios hold on a noisy machine).

Layers of a litgpt config (default SmolLM2-1.7B-Instruct: qkv, proj, fc_1, fc_2, mlp.proj per layer), distinct
random weights for `--layers` layers so nothing stays in cache, at M rows: ms per layer, weight GB/s, the
fraction of the plain read bandwidth, and the speed against float32's packed kernel on the same shapes.

    python benchmarks/quantized_linears.py --rows 1,8,64 --formats q8_0,q4_0,q4_1,q4_k,q6_k
    python benchmarks/quantized_linears.py --rows 1,2,4,8,16 --int8   # each format also on int8 activations
"""

from __future__ import annotations

import argparse

import litgpt
import numpy as np
import torch
from linear_bandwidth import best  # benchmarks/ is the script's dir: on sys.path

from thunder_batch import quantized
from thunder_batch.bench.report import machine_info
from thunder_batch.native import build


def shapes(config: litgpt.Config) -> list[tuple[int, int]]:
    qkv = (config.n_head + 2 * config.n_query_groups) * config.head_size
    c, i = config.n_embd, config.intermediate_size
    return [(qkv, c), (c, config.n_head * config.head_size), (i, c), (i, c), (c, i)]


def best_ms(fn, reps: int) -> float:
    return 1000 * best(fn, reps)


def layer_runs(config, layers: int, rows: int, formats: list[str], int8: bool) -> dict:
    """name -> (a pass over all layers' linears at `rows` rows, weight bytes read by it)."""
    runs = {}
    xs = {i: torch.randn(rows, i) for _, i in shapes(config)}
    dense = [torch.randn(o, i) * 0.02 for _ in range(layers) for o, i in shapes(config)]
    packed = [(build.pack_linear_weight(w), w.shape[0]) for w in dense]
    runs["float32 packed"] = (
        lambda: [build.packed_linear(xs[p.shape[1]], p, None, o) for p, o in packed],
        sum(w.numel() * 4 for w in dense),
    )
    del dense
    for name in formats:
        kind = quantized.FORMATS[name]
        blocks = [
            (torch.from_numpy(quantized.random_blocks(name, o, i, seed=n)), i)
            for n, (o, i) in enumerate(shapes(config))
        ]
        blocks = [(b.clone(), i) for _ in range(layers) for b, i in blocks]
        for mode in (False, True) if int8 else (False,):
            runs[name + (" int8" if mode else "")] = (
                lambda blocks=blocks, kind=kind, mode=mode: [
                    torch.ops.thunder_batch.quantized_linear(xs[i], b, None, kind, i, mode) for b, i in blocks
                ],
                sum(b.numel() for b, _ in blocks),
            )
    return runs


def read_gbps(nbytes: int = 1 << 30) -> float:
    data = torch.ones(nbytes // 4)
    return nbytes / best_ms(lambda: data.sum(), 5) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-1.7B-Instruct")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--formats", default="q8_0,q4_0,q4_1,q4_k,q6_k")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--int8", action="store_true", help="each format also with int8_activations (name int8)")
    args = parser.parse_args()
    config = litgpt.Config.from_name(args.model)
    bandwidth = read_gbps()
    info = machine_info(torch.device("cpu"))
    print(
        f"{args.model}, {args.layers} layers, torch threads {torch.get_num_threads()}, plain read {bandwidth:.1f} GB/s"
    )
    flags = sorted(build.cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"})
    print(f"machine: {info}; flags: {' '.join(flags)}")
    print("| rows | weights | ms per layer | weight GB/s | of plain read | speed vs float32 packed |")
    print("|---|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        runs = layer_runs(config, args.layers, rows, args.formats.split(","), args.int8)
        times = {name: best_ms(fn, args.reps) for name, (fn, _) in runs.items()}
        base = times["float32 packed"]
        for name, (_, nbytes) in runs.items():
            gbps = nbytes / times[name] / 1e6
            print(
                f"| {rows} | {name} | {times[name] / args.layers:.2f} | {gbps:.1f} | {gbps / bandwidth:.0%} |"
                f" {base / times[name]:.2f}x |"
            )


if __name__ == "__main__":
    np.random.seed(0)
    main()
