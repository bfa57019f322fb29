"""Cost of one KV cache write: element-wise `scatter_` against the row-wise `index_copy_` that
`index_copy_rows` uses, per dtype and rows per slot (1: a decode row, 16: a prefill lane).

    python benchmarks/kv_write.py --batch-size 128

Cache [B, G, S + C, D] with the default model's G=3 KV heads, D=64, S + C = 272; T new positions
per slot. Prints milliseconds per write (best of 20) and checks both writes give the same cache.
"""

from __future__ import annotations

import argparse
import time

import torch

from thunder_batch.index_ops import index_copy_rows


def scatter_write(cache: torch.Tensor, pos: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """The earlier write: `scatter_` along the position dim with the index expanded to `val`'s shape."""
    B, T = pos.shape
    return cache.scatter_(2, pos.view(B, 1, T, 1).expand(val.shape), val)


def best_ms(write, *args, reps: int = 20) -> float:
    write(*args)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        write(*args)
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    B, G, L, D = args.batch_size, 3, 272, 64
    print("| dtype | T | scatter_ ms | index_copy_ ms | scatter_ / index_copy_ |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for T in (1, 16):
            pos = torch.stack([torch.randperm(256)[:T] for _ in range(B)])  # [B, T] distinct per row
            val = torch.randn(B, G, T, D).to(dtype)
            a, b = torch.zeros(B, G, L, D, dtype=dtype), torch.zeros(B, G, L, D, dtype=dtype)
            s = best_ms(scatter_write, a, pos, val)
            slot = torch.arange(B).repeat_interleave(T)  # [B*T]: T rows of each slot
            rows = val.permute(0, 2, 1, 3).reshape(B * T, G, D)  # [B*T, G, D]
            c = best_ms(index_copy_rows, b, 2, slot, pos.reshape(B * T), rows)
            assert torch.equal(a, b)
            print(f"| {str(dtype).removeprefix('torch.')} | {T} | {s:.3f} | {c:.3f} | {s / c:.0f}x |")


if __name__ == "__main__":
    main()
