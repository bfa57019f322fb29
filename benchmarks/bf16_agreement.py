"""Greedy agreement in bf16 (and fp32 as control): engine vs litgpt, batched vs alone.

For each precision, on the default model (eager engine), N chat prompts of mixed lengths, 64 new
tokens each with EOS ignored, greedy. Per prompt it reports, for three comparisons on identical
token ids, "=" (all tokens identical) or the index of the first differing token:
  litgpt: engine batched (B slots, all prompts queued together) vs litgpt's one-at-a-time
          `generate_fn` in the same precision;
  alone1: engine batched vs the same request alone in a B=1 engine (the matmuls' M changes);
  aloneB: engine batched vs the same request alone in the same B-slot engine (M unchanged: empty
          slots are computed too), which tells M-dependence apart from batch-mate dependence.
Then `--probe` checks the ops themselves: is row i of F.linear(x[M, K]) the same as
F.linear(x[i:i+1])? (for the model's weight shapes, per M and dtype), and the same for the
attention kernel.

    PYTHONPATH=. python benchmarks/bf16_agreement.py --n 16 --batch 8 --new 64
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time

import torch
import torch.nn.functional as F

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.bench_workloads import load_prompts
from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def pick_prompts(engine: Engine, n: int) -> list[list[int]]:
    """n shipped prompts rendered as chats, evenly spread over the range of token lengths."""
    chats = [engine.encode([{"role": "user", "content": p}]) for p in load_prompts()]
    chats.sort(key=len)
    step = (len(chats) - 1) / max(n - 1, 1)
    return [chats[round(i * step)] for i in range(n)]


def litgpt_greedy(gpt, prompt: list[int], new: int) -> list[int]:
    """litgpt's own single-prompt generate_fn (the oracle), on a fresh KV cache."""
    from litgpt.generate.base import generate_fn

    gpt.set_kv_cache(batch_size=1, max_seq_length=len(prompt) + new)
    out = generate_fn(
        gpt, torch.tensor(prompt), len(prompt) + new, temperature=0.0, include_prompt=False, include_eos=False
    )
    return [int(t) for t in out]


def first_diff(a: list[int], b: list[int]) -> str:
    """'=' when identical, else the index of the first differing token."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return str(i)
    return "=" if len(a) == len(b) else str(min(len(a), len(b)))


def engine_for(dtype, batch: int, max_len: int, chunk: int) -> Engine:
    cfg = EngineConfig(batch_size=batch, max_seq_length=max_len, prefill_chunk=chunk, compile="eager")
    return Engine.from_checkpoint(default_checkpoint_dir(), cfg, dtype=dtype)


def run_precision(name: str, args) -> list[dict]:
    """One precision: token lists of the four systems per prompt, and the three comparisons."""
    dtype = DTYPES[name]
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True, temperature=0.0)
    big = engine_for(dtype, args.batch, args.max_len, args.chunk)
    prompts = pick_prompts(big, args.n)
    t0 = time.perf_counter()
    batched = [r.token_ids for r in big.generate(prompts, params)]
    t1 = time.perf_counter()
    alone_b = [big.generate([p], params)[0].token_ids for p in prompts] if args.alone_b else None
    t2 = time.perf_counter()
    one = engine_for(dtype, 1, args.max_len, args.chunk)
    alone_1 = [r.token_ids for r in one.generate(prompts, params)]
    t3 = time.perf_counter()
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=dtype)
    oracle = [litgpt_greedy(gpt, p, args.new) for p in prompts]
    t4 = time.perf_counter()
    print(
        f"# {name}: batched {t1 - t0:.0f} s, alone in B={args.batch} {t2 - t1:.0f} s, "
        f"B=1 {t3 - t2:.0f} s, litgpt {t4 - t3:.0f} s",
        flush=True,
    )
    rows = []
    for i, p in enumerate(prompts):
        rows.append(
            dict(
                prompt_len=len(p),
                litgpt=first_diff(batched[i], oracle[i]),
                alone1=first_diff(batched[i], alone_1[i]),
                aloneB=first_diff(batched[i], alone_b[i]) if alone_b else "-",
                b1_vs_litgpt=first_diff(alone_1[i], oracle[i]),
            )
        )
    return rows


def print_table(name: str, rows: list[dict], batch: int) -> None:
    cols = ["prompt_len", "litgpt", "alone1", "aloneB", "b1_vs_litgpt"]
    heads = [
        "prompt tokens",
        f"B={batch} vs litgpt",
        f"B={batch} vs B=1",
        f"B={batch} vs alone in B={batch}",
        "B=1 vs litgpt",
    ]
    print(f"\n### {name}\n\n| # | " + " | ".join(heads) + " |\n" + "|---" * (len(cols) + 1) + "|")
    for i, r in enumerate(rows):
        print(f"| {i} | " + " | ".join(str(r[c]) for c in cols) + " |")
    same = {c: sum(r[c] == "=" for r in rows) for c in cols[1:]}
    print("| identical | " + " | ".join(f"{same[c]}/{len(rows)}" for c in cols[1:]) + " |", flush=True)


def tiled_linear(x, w, tile: int = 32):
    """F.linear over fixed blocks of <= `tile` rows: each row then sees the same kernel whatever M is
    (on this CPU bf16 rows are M-invariant up to M = 32). x: [M, K], w: [N, K] -> [M, N]."""
    return torch.cat([F.linear(x[i : i + tile], w) for i in range(0, x.shape[0], tile)])


def use_tiled_linears() -> None:
    """Route every F.linear (nn.Linear included) through tiled_linear, for the --tiled experiment."""
    plain = F.linear

    def linear(x, w, b=None):
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        out = torch.cat([plain(flat[i : i + 32], w, b) for i in range(0, flat.shape[0], 32)])  # [M, N]
        return out.reshape(*x.shape[:-1], w.shape[0])

    F.linear = linear


def tiling_cost(dtype, m: int = 256, reps: int = 20) -> str:
    """Min ms of F.linear vs tiled_linear for the MLP's fc shape at M rows, and whether tiling is M-invariant."""
    torch.manual_seed(2)
    w, x = (torch.randn(1536, 576) / 24).to(dtype), torch.randn(m, 576).to(dtype)  # [N, K], [M, K]
    times = []
    for fn in (F.linear, tiled_linear):  # fastest of reps (the machine is shared)
        fn(x, w)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            fn(x, w)
            best = min(best, time.perf_counter() - start)
        times.append(best * 1e3)
    alone = torch.cat([F.linear(x[i : i + 1], w) for i in range(m)])  # [M, N]
    same = torch.equal(tiled_linear(x, w), alone)
    return f"M={m}: F.linear {times[0]:.2f} ms, 32-row tiles {times[1]:.2f} ms, tiles == rows alone: {same}"


def linear_row_invariance(dtype, ms=(1, 2, 8, 16, 32, 64, 128, 256, 512)) -> dict:
    """For the model's linear shapes: max |F.linear(x)[i] - F.linear(x[i:i+1])| over rows, per M."""
    torch.manual_seed(0)
    shapes = {
        "qkv": (576, 960),
        "proj": (576, 576),
        "fc": (576, 1536),
        "mlp.proj": (1536, 576),
        "lm_head": (576, 49152),
    }
    out = {}
    for label, (k, n) in shapes.items():
        w = (torch.randn(n, k) / k**0.5).to(dtype)  # [N, K]
        for m in ms:
            x = torch.randn(m, k).to(dtype)  # [M, K]
            full = F.linear(x, w)  # [M, N]
            rows = torch.cat([F.linear(x[i : i + 1], w) for i in range(m)])  # [M, N]
            out[(label, m)] = (full.float() - rows.float()).abs().max().item()
    return out


def sdpa_row_invariance(dtype, cache_len: int = 256) -> dict:
    """The engine's attention call (folded GQA heads, bool mask over the cache): slot 0 in a batch of
    B slots vs alone, max abs difference, per (B, T)."""
    torch.manual_seed(1)
    out = {}
    for b, t in ((8, 1), (8, 32), (32, 1)):
        q = torch.randn(b, 3, 3 * t, 64).to(dtype)  # [B, G, (H/G)*T, D]
        k, v = (torch.randn(b, 3, cache_len, 64).to(dtype) for _ in range(2))  # [B, G, L, D]
        mask = torch.arange(cache_len) <= torch.randint(t, cache_len, (b, 1, 3 * t, 1))  # [B, 1, 3T, L]
        full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, G, 3T, D]
        alone = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=mask[:1])
        out[(b, t)] = (full[:1].float() - alone.float()).abs().max().item()
    return out


@torch.no_grad()
def ops_that_change(dtype, rows: int = 8, t: int = 32) -> tuple[list[str], list[float]]:
    """litgpt forward (no cache) of one prompt alone [1, t] vs as row 0 of [rows, t]. Returns the leaf
    modules whose row-0 input is bit-identical in both runs but whose output is not (the ops that
    depend on M = rows * t), and the max |difference| of row 0 after each transformer block."""
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=dtype)
    blocks = {f"transformer.h.{i}" for i in range(gpt.config.n_layer)}
    seen: dict[str, list] = {}

    def record(name):
        return lambda mod, inp, out: seen.setdefault(name, []).append((inp[0][0].clone(), out[0].clone()))

    for name, mod in gpt.named_modules():
        if name in blocks or (name and not list(mod.children())):  # blocks, linears, norms, embedding
            mod.register_forward_hook(record(name))
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, gpt.config.vocab_size, (rows, t), generator=gen)  # [rows, t]
    gpt(batch[:1])
    gpt(batch)
    diff = {n: (a[1].float() - b[1].float()).abs().max().item() for n, (a, b) in seen.items()}
    culprits = [
        f"{n} ({diff[n]:.3g})"
        for n, (a, b) in seen.items()
        if n not in blocks and torch.equal(a[0], b[0]) and diff[n] > 0
    ]
    return culprits, [diff[f"transformer.h.{i}"] for i in range(gpt.config.n_layer)]


def probe() -> None:
    for name, dtype in DTYPES.items():
        lin = linear_row_invariance(dtype)
        labels = sorted({lab for lab, _ in lin}, key=list(dict.fromkeys(lab for lab, _ in lin)).index)
        ms = sorted({m for _, m in lin})
        print(f"\n### F.linear row i of [M, K] vs alone, {name}: max abs difference\n")
        print("| M | " + " | ".join(labels) + " |\n" + "|---" * (len(labels) + 1) + "|")
        for m in ms:
            print(f"| {m} | " + " | ".join(f"{lin[(lab, m)]:.3g}" for lab in labels) + " |")
        print(f"\nsdpa slot 0 alone vs in batch, {name}: {sdpa_row_invariance(dtype)}", flush=True)
        print(f"\nfc linear, {name}: {tiling_cost(dtype)}")
        for rows, t in ((8, 32), (8, 1)):
            ops, layers = ops_that_change(dtype, rows, t)
            print(
                f"\nlitgpt forward, row 0 alone [1, {t}] vs in [{rows}, {t}], {name}: modules with an identical "
                f"row-0 input and a different output (max abs diff): {ops[:6]}; row-0 max abs diff after "
                f"each block: {' '.join(f'{d:.2g}' for d in layers)}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--precisions", default="bfloat16,float32")
    ap.add_argument("--alone_b", type=int, default=1, help="also run each request alone in the B-slot engine")
    ap.add_argument("--probe", type=int, default=1)
    ap.add_argument("--tiled", type=int, default=0, help="run every linear in blocks of <= 32 rows")
    args = ap.parse_args()
    if args.tiled:
        use_tiled_linears()
    flags = subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"# torch {torch.__version__}, {platform.machine()}, threads {torch.get_num_threads()}\n# {flags}")
    print(f"# {vars(args)}")
    for name in filter(None, args.precisions.split(",")):
        print_table(name, run_precision(name, args), args.batch)
    if args.probe:
        probe()


if __name__ == "__main__":
    main()
