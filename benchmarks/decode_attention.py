"""A decode step's attention: torch's sdpa against the project's native kernel (`compile/attention.py`).

q [B, 3, 3, 64] (the default model's 9 heads over 3 K/V groups, one position each), k and v strided views
of a [B, 3, 289, 64] slot cache's first L = 256 entries, slot b seeing 20 + 3b entries (slot 0 none: a
padding row), microseconds per call, 2 threads; the error of each against float64.

    python benchmarks/decode_attention.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from thunder_batch.compile.attention import decode_attention
from thunder_batch.native.build import unavailable


def per_call_us(fn, args, calls: int = 100) -> float:
    for _ in range(5):
        fn(*args[:3], attn_mask=args[3], scale=0.125)
    start = time.perf_counter()
    for _ in range(calls):
        fn(*args[:3], attn_mask=args[3], scale=0.125)
    return (time.perf_counter() - start) / calls * 1e6


def inputs(B: int, dtype, G=3, Q=3, L=256, D=64):
    cache = torch.randn(2, B, G, L + 33, D, dtype=dtype)
    k, v = cache[0, :, :, :L], cache[1, :, :, :L]  # [B, G, L, D] views
    q = torch.randn(B, G, Q, D, dtype=dtype)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype)
    for b in range(B):
        mask[b, ..., 20 + 3 * b :] = torch.finfo(dtype).min
    mask[0] = torch.finfo(dtype).min
    return q, k, v, mask


def main() -> None:
    torch.set_num_threads(2)
    if unavailable():
        raise SystemExit(f"native kernels unavailable: {unavailable()}")
    for dtype in (torch.float32, torch.bfloat16):
        for B in (2, 8, 64):
            q, k, v, mask = inputs(B, dtype)
            exact = F.scaled_dot_product_attention(*(t.double() for t in (q, k, v, mask)), scale=0.125)[1:]
            err = {}
            for name, fn in (("sdpa", F.scaled_dot_product_attention), ("native", decode_attention)):
                err[name] = (fn(q, k, v, attn_mask=mask, scale=0.125)[1:].double() - exact).abs().max().item()
                err[name + "_us"] = per_call_us(fn, (q, k, v, mask))
            print(
                f"{str(dtype):15} B={B:<3} sdpa {err['sdpa_us']:7.0f} us (err {err['sdpa']:.1e})  "
                f"native {err['native_us']:7.0f} us (err {err['native']:.1e})",
                flush=True,
            )


if __name__ == "__main__":
    main()
