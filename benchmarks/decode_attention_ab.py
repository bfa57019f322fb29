"""The native decode attention against another version of its source, side by side in one process.

The other source is built under its own op namespace (`decode_attention_ab`), so both kernels run on
the same inputs in one run (this machine's memory bandwidth drifts between runs). Microseconds per call,
2 threads, error against float64: "hot" repeats one call (keys and values in L2), "cold" runs one call
per layer over 30 layers' caches after a 64 MiB write has evicted them (a step's situation).

    git show 49b0deb:thunder_batch/native/decode_attention.cpp > /tmp/before.cpp
    python benchmarks/decode_attention_ab.py /tmp/before.cpp
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from thunder_batch.native import build

CASES = [  # B, Q (query rows per group), D, L (rung), visible entries per slot
    (1, 3, 64, 256, 100),
    (8, 3, 64, 256, 100),
    (64, 3, 64, 256, 128),
    (8, 3, 64, 2048, 1500),
    (4, 7, 80, 64, 37),
    (2, 16, 128, 64, 33),
]


def other_kernel(source: Path):
    text = source.read_text().replace("(thunder_batch,", "(decode_attention_ab,")
    folder = Path(tempfile.mkdtemp(prefix="decode_attention_ab_"))
    (folder / "other.cpp").write_text(text)
    load(
        name="decode_attention_ab",
        sources=[str(folder / "other.cpp")],
        extra_cflags=build.FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        is_python_module=False,
    )
    return torch.ops.decode_attention_ab.decode_attention


def layer_inputs(B, Q, D, L, live, dtype, G=3):
    cache = torch.randn(2, B, G, L + 7, D).to(dtype)  # k, v: [B, G, L, D] views, rows 7 entries apart at the end
    mask = torch.full((B, 1, 1, L), float("-inf"), dtype=dtype)
    mask[..., :live] = 0
    return torch.randn(B, G, Q, D).to(dtype), cache[0, :, :, :L], cache[1, :, :, :L], mask


def hot_us(op, args, calls):
    for _ in range(10):
        op(*args, 0.125)
    start = time.perf_counter()
    for _ in range(calls):
        op(*args, 0.125)
    return (time.perf_counter() - start) / calls * 1e6


def cold_us(op, layers, flush):
    times = []
    for _ in range(5):
        flush.add_(1)
        start = time.perf_counter()
        for args in layers:
            op(*args, 0.125)
        times.append(time.perf_counter() - start)
    return sorted(times)[2] / len(layers) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("other", type=Path, help="a decode_attention.cpp to time beside the installed one")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if build.unavailable():
        raise SystemExit(f"native kernels unavailable: {build.unavailable()}")
    kernels = {"other": other_kernel(args.other), "this": torch.ops.thunder_batch.decode_attention}
    flush = torch.empty(64 << 20, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        for B, Q, D, L, live in CASES:
            layers = [layer_inputs(B, Q, D, L, live, dtype) for _ in range(30)]
            exact = F.scaled_dot_product_attention(*(t.double() for t in layers[0]), scale=0.125)
            line = f"{str(dtype)[6:]:8} B={B:<2} Q={Q:<2} D={D:<3} L={L:<4} visible {live:<4}"
            for name, op in kernels.items():
                err = (op(*layers[0], 0.125).double() - exact).abs().max().item()
                hot = hot_us(op, layers[0], max(100, 10000 // B))
                line += f" | {name} hot {hot:7.1f} cold {cold_us(op, layers, flush):7.1f} us (err {err:.0e})"
            print(line, flush=True)


if __name__ == "__main__":
    main()
