"""Speculative decoding on one request that copies a passage: wall time of k drafts vs k = 0.

A chat asking the default model (SmolLM2-135M-Instruct, fp32) to repeat a ~70-word passage word for
word, B = 1, greedy and seeded (temperature 0.8, seed 123). One engine per k and setting
(--shared_engine: per k); each is warmed up (every step shape made, then one generate) so compile time
is excluded, then k=0 and k run alternately, `--reps` times each. Every generate is a whole request
(prompt included: prefix reuse is off). Prints each run, then one summary line per setting: median wall
times, the ratio (k=0 / k), and whether the tokens are identical; for k > 0 also the steps, verify
steps and drafts accepted / proposed.

    python benchmarks/speculative_copy.py --max_new_tokens 120 --speculative_tokens 4 --reps 5 \
        --compile thunder --cache_dir /tmp/copy_cc
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import default_checkpoint_dir

PASSAGE = (
    "The old lighthouse on Marrow Point was switched off in 1987, but the keepers' cottage still stands beside "
    "it. Every spring a group of volunteers repaints the door, clears the gutters and checks the small weather "
    "station on the roof. The station sends wind speed and air pressure to the harbour office every ten minutes, "
    "and on calm evenings the volunteers sit on the steps and watch the fishing boats come home."
)
PROMPT = [dict(role="user", content=f"Repeat the following passage word for word.\n\n{PASSAGE}")]


def settings(max_new_tokens: int) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(max_new_tokens=max_new_tokens),
        "seeded": SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=123),
    }


def make_engine(k: int, args, names: list[str]) -> Engine:
    """An engine with k speculative tokens, every step shape made and each of `names` run once."""
    config = EngineConfig(
        batch_size=1,
        max_seq_length=256,
        prefill_chunk=64,
        compile=args.compile,
        cache_dir=args.cache_dir,
        prefix_reuse=False,
        speculative_tokens=k,
    )
    engine = Engine.from_checkpoint(default_checkpoint_dir(), config, dtype=torch.float32)
    start = time.perf_counter()
    engine.warmup()
    for name in names:
        engine.generate([PROMPT], settings(args.max_new_tokens)[name])
    print(
        f"k={k} {'+'.join(names)}: warm-up (compile or load, then a generate each) {time.perf_counter() - start:.1f} s"
    )
    return engine


def make_engines(k: int, args) -> dict[tuple[str, int], Engine]:
    """(setting, k) -> engine: one per setting (the draft gate's state is per engine, and a seeded
    request's rejected drafts would close it for the greedy one), or with --shared_engine one per k."""
    names = list(settings(args.max_new_tokens))
    if args.shared_engine:
        shared = {key: make_engine(key, args, names) for key in (0, k)}
        return {(name, key): shared[key] for name in names for key in (0, k)}
    return {(name, key): make_engine(key, args, [name]) for name in names for key in (0, k)}


def timed_generate(engine: Engine, params: SamplingParams) -> dict:
    """One generate: wall and process CPU seconds (CPU well under threads x wall: the cores were taken
    by something else), tokens, and the steps / draft counters it added."""
    before = engine.stats()
    start, cpu = time.perf_counter(), time.process_time()
    [result] = engine.generate([PROMPT], params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = engine.stats()
    run = dict(
        wall_s=wall, tokens=result.token_ids, finish=result.finish_reason, steps=after["steps"] - before["steps"]
    )
    run["cpu_s"], run["text"] = cpu, result.text or ""
    run["exact_copy"] = run["text"].strip() == PASSAGE
    run["new_traces"] = sum(after[key] - before[key] for key in ("traced", "thunder_traces", "cache_misses"))
    for name, value in after.get("speculative", {}).items():
        run[name] = value - before["speculative"][name]
    return run


def describe(run: dict) -> str:
    text = f"{run['wall_s']:.3f} s (process CPU {run['cpu_s']:.2f} s), {len(run['tokens'])} tokens ({run['finish']})"
    text += f", {run['steps']} steps"
    text += f", text == passage: {'yes' if run['exact_copy'] else 'no'}, traced during the run: {run['new_traces']}"
    if "verify_steps" in run:
        text += f", {run['verify_steps']} verify steps, drafts {run['accepted_tokens']}/{run['draft_tokens']} accepted"
    return text


def summary(name: str, k: int, runs: dict[int, list[dict]]) -> str:
    """One line: medians, the ratio k=0 / k, identical tokens, and k's steps and acceptance (each run)."""
    base, spec = (statistics.median(r["wall_s"] for r in runs[key]) for key in (0, k))
    identical = all(r["tokens"] == runs[0][0]["tokens"] for key in (0, k) for r in runs[key])
    line = (
        f"{name}: k=0 median {base:.3f} s, k={k} median {spec:.3f} s, ratio {base / spec:.2f}x, "
        f"tokens identical: {'yes' if identical else 'NO'}, steps k=0 {runs[0][-1]['steps']} / "
        f"k={k} {' '.join(str(r['steps']) for r in runs[k])}"
    )
    if "verify_steps" in runs[k][-1]:
        drafts = " ".join(f"{r['accepted_tokens']}/{r['draft_tokens']}" for r in runs[k])
        line += f", verify steps {' '.join(str(r['verify_steps']) for r in runs[k])}, drafts accepted {drafts}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_new_tokens", type=int, default=120)
    parser.add_argument("--speculative_tokens", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compile", default="thunder", choices=["thunder", "eager"])
    parser.add_argument("--cache_dir", default=None, help="compile cache root (default: the engine's)")
    parser.add_argument("--shared_engine", action="store_true", help="one engine per k for both settings")
    args = parser.parse_args()
    k = args.speculative_tokens
    if k < 1:
        parser.error("--speculative_tokens must be >= 1 (it is compared with k = 0)")
    print(f"torch threads {torch.get_num_threads()}, compile={args.compile}, max_new_tokens={args.max_new_tokens}")
    engines = make_engines(k, args)
    runs = {name: {0: [], k: []} for name in settings(args.max_new_tokens)}
    for rep in range(args.reps):
        for key in (0, k):  # the engines alternate: k=0 then k, each setting, every repetition
            for name, params in settings(args.max_new_tokens).items():
                run = timed_generate(engines[name, key], params)
                runs[name][key].append(run)
                print(f"rep {rep} k={key} {name}: {describe(run)}")
    for name, by_k in runs.items():
        walls = ", ".join(f"k={key}: " + " ".join(f"{r['wall_s']:.3f}" for r in by_k[key]) for key in by_k)
        print(f"{name} runs (s) {walls}")
        print(f"{name} text (k=0, first run): {by_k[0][0]['text']!r}")
        print(summary(name, k, by_k))


if __name__ == "__main__":
    main()
