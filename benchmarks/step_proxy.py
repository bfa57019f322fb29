"""Issue 30's checkable proxy for the step's host work: median `Engine.step()` time of decode-only steps,
the default executors against `compile="eager"`, alternating in one process (the machine's speed drifts).

Every slot its own 64-token prompt of token ids, `max_seq_length=256`, `prefill_chunk=32`, 2 threads, the
default model's weights from `load_checkpoint` (bfloat16 unless told); the prompts are fed first, then
rounds of `--steps` timed steps per engine, eager and compiled in turn.

    python benchmarks/step_proxy.py --batch-sizes 1,8 --precision bfloat16 --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decoding_engine(gpt, compile: str, batch_size: int, cache_dir: str | None):
    """An engine whose every slot is past its prompt (the next steps decode only)."""
    from thunder_batch import Engine, EngineConfig, SamplingParams

    config = EngineConfig(
        batch_size=batch_size, max_seq_length=256, prefill_chunk=32, compile=compile, cache_dir=cache_dir
    )
    engine = Engine(gpt, config)
    generator = torch.Generator().manual_seed(batch_size)
    for _ in range(batch_size):
        prompt = torch.randint(1, 49000, (64,), generator=generator).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=180, ignore_eos=True))
    while any(r is None or r.num_cached < len(r.prompt_ids) for r in engine.scheduler.slots):
        engine.step()
    for _ in range(3):  # the decode shape made, the first calls' checks done
        engine.step()
    return engine


def timed_steps(engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def decode_step_arguments(precision: str, rounds: int, steps: int) -> argparse.ArgumentParser:
    """The options of the scripts that time decode-only steps (this one, steps_under_load.py)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--precision", default=precision)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--cache-dir", default=None, help="the compile cache (default: the engine's)")
    return parser


def main() -> None:
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint
    from thunder_batch.native.build import cpu_flags

    args = decode_step_arguments("bfloat16", rounds=5, steps=10).parse_args()
    torch.set_num_threads(2)
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512f", "avx512_bf16", "amx", "avx2")))
    print(f"CPU flags: {' '.join(flags)}; torch threads {torch.get_num_threads()}")
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=getattr(torch, args.precision))
    for batch_size in map(int, args.batch_sizes.split(",")):
        engines = {mode: decoding_engine(gpt, mode, batch_size, args.cache_dir) for mode in ("eager", "thunder")}
        times = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                times[mode] += timed_steps(engine, args.steps)
        eager, compiled = (1e3 * statistics.median(times[m]) for m in ("eager", "thunder"))
        print(
            f"{args.precision} B={batch_size}: decode step eager {eager:.2f} ms, default executors {compiled:.2f} ms:"
            f" {eager / compiled:.2f}x eager",
            flush=True,
        )


if __name__ == "__main__":
    main()
