"""Sort-free top-k/top-p candidate (bisection over the float bits) vs the sort in filter_top_k_top_p.

Candidate: per row, a 32-step bisection over order-preserving int keys of the float32 values finds
the k-th largest value (count of keys >= mid), then a second 32-step bisection finds the smallest
key whose strictly-higher probability mass (renormalised over the top-k ranks, ties at the k-th
value counted as the sort counts them) is below top_p. Keep = key >= that threshold. No sort,
no cumsum; 64 passes of compare + reduce over [B, V]. Mathematically the same keep-set as the sort;
float rounding of the mass sums differs (the sort uses a cumsum in sorted order), so the two can
disagree when the mass above a token is within float32 rounding of top_p.

`--check` compares keep-sets on ties, flat rows, top_k=1, top_k>=V, top_p=1, tiny top_p and mixed
random rows (eager, and under thunder.jit); then timings, eager and traced, with ratios vs the sort
measured in the same run:

    PYTHONPATH=. python benchmarks/sampler_filter.py --batches 8,32,128 --vocab 49152
"""

from __future__ import annotations

import argparse
import subprocess
import time

import torch
from torch import Tensor

from thunder_batch.sampler import batched_sample, filter_top_k_top_p


def float_keys(x: Tensor) -> Tensor:
    """int32 keys ordered as the float32 values (-0.0 folded into +0.0). x: [B, V] -> [B, V]."""
    bits = (x + 0.0).view(torch.int32)  # [B, V]; x + 0.0 turns -0.0 into +0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip magnitude bits


def key_to_float(key: Tensor) -> Tensor:
    """Inverse of float_keys. key: [B] int64 -> [B] float32."""
    key = key.to(torch.int32)
    return torch.where(key < 0, key ^ 0x7FFFFFFF, key).view(torch.float32)


def kth_largest_key(key: Tensor, k: Tensor) -> Tensor:
    """Largest K with count(key >= K) >= k, per row: the key of the k-th largest value. -> [B] int64."""
    lo = key.amin(-1).to(torch.int64)  # [B] count(key >= lo) = V >= k
    hi = key.amax(-1).to(torch.int64) + 1  # [B] count(key >= hi) = 0 < k
    for _ in range(32):
        mid = (lo + hi) >> 1  # [B]
        ok = (key >= mid.to(torch.int32)[:, None]).sum(-1) >= k  # [B]
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
    return lo


def nucleus_key(key: Tensor, probs: Tensor, kth: Tensor, top_p: Tensor) -> Tensor:
    """Smallest K >= kth with mass(key > K) < top_p, per row (probs renormalised over the top-k)."""
    lo = kth - 1  # [B] mass(key > kth - 1) >= 1 > top_p: condition false
    hi = key.amax(-1).to(torch.int64)  # [B] mass above the max is 0: condition true
    for _ in range(32):
        mid = (lo + hi) >> 1  # [B]
        above = torch.where(key > mid.to(torch.int32)[:, None], probs, 0.0).sum(-1)  # [B]
        ok = above < top_p  # [B]
        lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
    return hi


def filter_bisect(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Same contract as filter_top_k_top_p, without a sort. scaled: [B, V] float32."""
    vocab_size = scaled.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)  # [B]
    key = float_keys(scaled)  # [B, V]
    kth = kth_largest_key(key, k)  # [B]
    peak = scaled.amax(-1, keepdim=True)  # [B, 1]
    e = torch.exp(scaled - peak)  # [B, V]
    gt = key > kth.to(torch.int32)[:, None]  # [B, V]
    n_gt = gt.sum(-1)  # [B] < k
    e_kth = torch.exp(key_to_float(kth) - peak.squeeze(1))  # [B]
    z = torch.where(gt, e, 0.0).sum(-1) + (k - n_gt) * e_kth  # [B] mass of exactly k ranks
    cut = nucleus_key(key, e / z[:, None], kth, top_p)  # [B]
    cut = torch.where(top_p >= 1, kth, cut)  # [B] top_p 1 keeps the whole top-k
    return torch.where(key >= cut.to(torch.int32)[:, None], scaled, float("-inf"))  # [B, V]


def hard_cases(b: int, v: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Rows with ties, flat rows, sharp rows, -inf tails; params hitting every edge."""
    x = torch.randn(b, v, generator=gen) * torch.rand(b, 1, generator=gen) * 8  # [b, v]
    kind = torch.arange(b) % 6
    x[kind == 1] = x[kind == 1].round()  # many ties
    x[kind == 2] = 0.0  # flat
    x[kind == 3] = (x[kind == 3] * 4).round() / 4 * 10  # ties, sharp
    x[kind == 4, v // 2 :] = float("-inf")
    x[kind == 5] = -x[kind == 5].abs()  # all <= 0, with -0.0 from rounding below
    x[kind == 5, :3] = -0.0
    choices_k = torch.tensor([0, 1, 2, 5, 50, v - 1, v, v + 3])
    top_k = choices_k[torch.randint(0, len(choices_k), (b,), generator=gen)]
    choices_p = torch.tensor([1.0, 1.0, 1e-6, 0.1, 0.5, 0.9, 0.99, 0.999999])
    top_p = choices_p[torch.randint(0, len(choices_p), (b,), generator=gen)]
    return x, top_k, top_p


def check(trials: int, vocab: int, jit=None) -> None:
    """Keep-sets of the candidate vs the sort (eager, and traced when jit is given)."""
    gen = torch.Generator().manual_seed(0)
    f = jit(filter_bisect) if jit else filter_bisect
    rows = diff_rows = 0
    for _ in range(trials):
        x, top_k, top_p = hard_cases(24, vocab, gen)
        ref = filter_top_k_top_p(x, top_k, top_p) > float("-inf")  # [b, v]
        got = f(x, top_k, top_p) > float("-inf")
        bad = (ref != got).any(-1)  # [b]
        rows += len(bad)
        diff_rows += int(bad.sum())
        for i in bad.nonzero().flatten().tolist()[:3]:
            print(f"  differs: k={int(top_k[i])} p={float(top_p[i])} kept {int(ref[i].sum())} vs {int(got[i].sum())}")
    print(f"check ({'traced' if jit else 'eager'}, V={vocab}): {diff_rows} of {rows} rows differ", flush=True)


def timed(fn, *args, reps: int) -> float:
    """Fastest of `reps` calls in ms, after one warm-up (the minimum resists a machine shared with others)."""
    fn(*args)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def bench(batches: list[int], vocab: int, reps: int, jit=None) -> None:
    """min ms per call: the sort filter, the candidate, and the whole sampler with and without its sort."""
    print(
        "\n| B | mode | sort filter ms | bisect ms | bisect/sort | sample ms | unsorted sample ms | unsorted/sample |"
    )
    print("|---" * 8 + "|")
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        x = torch.randn(b, vocab, generator=gen) * 3  # [B, V]
        top_k, top_p = torch.full((b,), 50), torch.full((b,), 0.9)
        temp, seed, pos = torch.full((b,), 0.8), torch.arange(b), torch.arange(b) + 100
        modes = [("eager", lambda f: f)] + ([("thunder", jit)] if jit else [])
        for mode, wrap in modes:
            s = timed(wrap(filter_top_k_top_p), x, top_k, top_p, reps=reps)
            c = timed(wrap(filter_bisect), x, top_k, top_p, reps=reps)
            full = timed(wrap(batched_sample), x, temp, top_k, top_p, seed, pos, reps=reps)
            plain = wrap(lambda *a: batched_sample(*a, sort=False))
            u = timed(plain, x, temp, top_k, top_p, seed, pos, reps=reps)
            row = f"| {b} | {mode} | {s:.1f} | {c:.1f} | {c / s:.2f} | {full:.1f} | {u:.1f} | {u / full:.2f} |"
            print(row, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check", type=int, default=20, help="randomized trials of 24 rows (0: skip)")
    ap.add_argument("--thunder", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("# " + subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True).stdout.strip())
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, {vars(args)}")
    jit = None
    if args.thunder:
        from thunder_batch._compat import import_thunder

        jit = import_thunder().jit
    if args.check:
        check(args.check, 1000)
        check(max(1, args.check // 4), args.vocab)
        if jit:
            check(max(1, args.check // 4), 1000, jit)
    bench([int(b) for b in args.batches.split(",")], args.vocab, args.reps, jit)


if __name__ == "__main__":
    main()
