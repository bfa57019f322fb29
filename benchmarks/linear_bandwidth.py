"""Weight read bandwidth of the default model's linear layers at small row counts, per kernel.

Every linear of SmolLM2-135M (30 layers x qkv, proj, fc_1, fc_2, mlp.proj, plus lm_head), distinct
weights so nothing stays in cache, at M rows: weight bytes / time per pass over all of them, against a
plain read of the same bytes. Kernels: aten F.linear, oneDNN prepacked (`_linear_pointwise`), MKL
packed (fp32), and the project's own kernels (`thunder_batch.native`: fp32; bf16 where the CPU has
AVX512-BF16 or AVX2, on AMX tiles where the CPU has AMX-BF16) when built. At prompt-step rows the
GFLOP/s column is the one that counts.

    python benchmarks/linear_bandwidth.py --rows 1,8 --dtypes bfloat16,float32
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in) per layer


def weights(dtype, layers: int):
    ws = [torch.randn(o, i, dtype=torch.float32).to(dtype) * 0.02 for _ in range(layers) for o, i in SHAPES]
    return ws + [torch.randn(49152, 576).to(dtype) * 0.02]


def best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def kernels(ws, x_for, rows: int, dtype):
    out = {"aten": lambda: [F.linear(x_for(w), w) for w in ws]}
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in ws]
        out["onednn-packed"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(x_for(w), p, None, "none", [], "") for w, p in zip(ws, packed)
        ]
    except Exception as e:  # not built with oneDNN here
        print(f"  onednn-packed unavailable: {e}")
    if dtype == torch.float32:
        try:
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in ws]
            out["mkl-packed"] = lambda: [torch.ops.mkl._mkl_linear(x_for(w), p, w, None, rows) for w, p in zip(ws, mkl)]
        except Exception as e:
            print(f"  mkl-packed unavailable: {e}")
    if dtype == torch.bfloat16:
        try:
            from thunder_batch.native.build import amx_runs, bf16_available, pack_linear_weight_bf16, packed_linear_bf16

            if not bf16_available():
                raise RuntimeError("no AVX512-BF16 here, or the kernels are not built")
            ours = [pack_linear_weight_bf16(w) for w in ws]
            name = "packed_bf16/amx" if amx_runs(ws[0].shape[1]) else "packed_bf16"  # AMX tiles where present
            out[name] = lambda: [packed_linear_bf16(x_for(w), p, None, w.shape[0]) for w, p in zip(ws, ours)]
        except Exception as e:
            print(f"  packed_linear_bf16 unavailable: {type(e).__name__}: {e}")
    if dtype == torch.float32:
        try:
            from thunder_batch.native.build import pack_linear_weight, packed_linear, unavailable

            if unavailable():
                raise RuntimeError(unavailable())
            ours = [pack_linear_weight(w) for w in ws]
            out["packed_linear"] = lambda: [packed_linear(x_for(w), p, None, w.shape[0]) for w, p in zip(ws, ours)]
        except Exception as e:
            print(f"  packed_linear unavailable: {type(e).__name__}: {e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}")
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        ws = weights(dtype, args.layers)
        total = sum(w.numel() * w.element_size() for w in ws)
        w_bytes = ws[0].element_size()
        flat = torch.cat([w.reshape(-1) for w in ws])
        words = flat.view(torch.float32)  # the same bytes, summed as float32 words: a plain read
        read = best(words.sum, args.reps)
        print(f"{dtype}: {total / 1e6:.0f} MB of weights; plain read {total / read / 1e9:.1f} GB/s")
        for rows in map(int, args.rows.split(",")):
            xs = {i: torch.randn(rows, i).to(dtype) for i in {w.shape[1] for w in ws}}
            reference = [F.linear(xs[w.shape[1]], w) for w in ws]
            for name, fn in kernels(ws, lambda w, xs=xs: xs[w.shape[1]], rows, dtype).items():
                try:
                    got = fn()
                except RuntimeError as e:
                    print(f"  M={rows:<3} {name:<14} failed: {str(e)[:80]}")
                    continue
                exact = all(torch.equal(a, b) for a, b in zip(got, reference))
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, reference))
                s = best(fn, args.reps)
                rate, flops = total / s / 1e9, 2 * rows * total / w_bytes / s / 1e9
                print(
                    f"  M={rows:<3} {name:<15} {s * 1e3:7.2f} ms  {rate:5.1f} GB/s  {flops:6.0f} GFLOP/s"
                    f"  exact={exact} err={err:.2e}"
                )
        del ws, flat


if __name__ == "__main__":
    main()
