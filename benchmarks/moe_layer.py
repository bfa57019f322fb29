"""One real-size mixture-of-experts layer (random weights): the fixed-shape layouts of `thunder_batch.moe`
against litgpt's own `LLaMAMoE` (data-dependent shapes), at 1, 8 and 64 rows.

    python benchmarks/moe_layer.py --models Qwen3-30B-A3B,Mixtral-8x7B-v0.1 --dtypes bfloat16 --rows 1,8,64

Shapes come from litgpt's named configs (`Config.from_name`). For each layout: milliseconds per call
(best and median of --repeats, the layouts taking turns), the max difference from litgpt's output, and its cost
against the active experts only: active FLOPs (2 x rows x k x 3 x C x I) at the peak matmul rate
measured in this run, and the active experts' weight bytes (distinct experts the rows route to) at the
copy bandwidth measured in this run. `gathered` is skipped where its weight copy would exceed
--max-copy-gb. With a loaded machine, `--threads 1 --clock cpu` times this thread's CPU time.
Writes --output-json if given.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from functools import partial

import torch
from litgpt import Config
from litgpt.model import LLaMAMoE

from thunder_batch.moe import StackedExperts, dense, gathered, grouped

LAYOUTS = {"grouped": grouped, "gathered": gathered, "dense": dense}


def random_moe(config: Config, dtype: torch.dtype) -> LLaMAMoE:
    """litgpt's LLaMAMoE made on the meta device and filled in `dtype` (never an fp32 copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            moe = LLaMAMoE(config)
    finally:
        torch.set_default_dtype(previous)
    moe = moe.to_empty(device="cpu").requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return moe.eval()


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def best_ms(fn, repeats: int, clock) -> float:
    return interleaved_ms({"fn": fn}, repeats, clock)["fn"][0]


def interleaved_ms(fns: dict, repeats: int, clock) -> dict[str, tuple[float, float]]:
    """(best, median) milliseconds per call of each function, the functions taking turns in each
    round, so a burst of load from elsewhere hits them alike."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            times[name].append(1000 * (clock() - start))
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def peak_matmul(dtype: torch.dtype, clock, n: int = 2048) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / (best_ms(lambda: a @ b, 5, clock) / 1000)


def copy_bandwidth(clock) -> float:
    src = torch.empty(256 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (best_ms(lambda: dst.copy_(src), 5, clock) / 1000)  # read + write


def measure(name: str, dtype: torch.dtype, args, rates: dict) -> list[dict]:
    config = Config.from_name(name)
    moe = random_moe(config, dtype)
    experts = StackedExperts(moe)  # the model's expert weights become views of the stacks
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        row = measure_rows(moe, experts, torch.randn(rows, config.n_embd, dtype=dtype), args, rates)
        results.append(dict(model=name, **row))
        print(table_row(results[-1]), flush=True)
    del moe, experts
    gc.collect()
    return results


@torch.no_grad()
def measure_rows(moe, experts: StackedExperts, x, args, rates: dict) -> dict:
    """One layer at one row count: litgpt's LLaMAMoE and each layout, timed taking turns."""
    cfg = moe.config
    rows, k, C, inner = x.shape[0], cfg.n_expert_per_token, cfg.n_embd, experts.proj.shape[2]
    expert_bytes = 3 * inner * C * experts.fc.element_size()
    probs, indices = experts.route(x)
    want = moe(x.unsqueeze(0))[0]
    active = indices.unique().numel()
    flops, active_bytes = 2 * rows * k * 3 * C * inner, active * expert_bytes
    row = dict(dtype=str(x.dtype).removeprefix("torch."), rows=rows, experts=cfg.n_expert, per_token=k)
    row.update(active_experts=active, active_gflop=flops / 1e9, active_weight_mb=active_bytes / 2**20)
    row["floor_ms"] = 1000 * max(flops / rates["matmul"], active_bytes / rates["copy"])
    fns = {"litgpt": lambda: moe(x.unsqueeze(0))}
    for layout, fn in LAYOUTS.items():
        row[f"{layout}_ms"] = None
        if layout == "gathered" and rows * k * expert_bytes / 2**30 > args.max_copy_gb:
            continue
        row[f"{layout}_max_diff"] = float((fn(experts, x, probs, indices).float() - want.float()).abs().max())
        fns[layout] = partial(fn, experts, x, probs, indices)
    for name, (best, median) in interleaved_ms(fns, args.repeats, CLOCKS[args.clock]).items():
        row[f"{name}_ms"], row[f"{name}_median_ms"] = best, median
    return row


def table_row(row: dict) -> str:
    def cell(layout):
        ms = row[f"{layout}_ms"]
        return "-" if ms is None else f"{ms:.1f} ({ms / row['floor_ms']:.1f}x)"

    cells = [row["model"], row["dtype"], row["rows"], row["active_experts"], f"{row['litgpt_ms']:.1f}"]
    return "| " + " | ".join(str(c) for c in cells + [cell(layout) for layout in LAYOUTS]) + " |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="Qwen3-30B-A3B,Mixtral-8x7B-v0.1")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-copy-gb", type=float, default=2.0, help="skip `gathered` beyond this weight copy")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall", help="cpu: this thread's CPU time (with --threads 1: robust to load)"
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    machine = platform.processor() or platform.machine()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {machine}, {args.clock} clock")
    print("| model | dtype | rows | active experts | litgpt ms | " + " | ".join(f"{n} ms (x floor)" for n in LAYOUTS))
    print("|---" * (5 + len(LAYOUTS)) + "|")
    results, peaks = [], {}
    copy_bw = copy_bandwidth(clock)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        rates = dict(matmul=peak_matmul(dtype, clock), copy=copy_bw)
        peaks[dtype_name] = dict(matmul_gflops=rates["matmul"] / 1e9, copy_gbs=copy_bw / 1e9)
        for name in args.models.split(","):
            results += measure(name, dtype, args, rates)
    print("peaks:", json.dumps(peaks))
    if args.output_json:
        with open(args.output_json, "w") as f:
            info = dict(torch=torch.__version__, threads=torch.get_num_threads(), clock=args.clock, peaks=peaks)
            json.dump(dict(info, command=sys.argv, results=results), f)


if __name__ == "__main__":
    main()
