"""What the logit controls cost a step: the same B greedy requests plain, with one row controlled, and with every
row controlled (repetition + frequency penalty and a logit_bias), on the default model, compiled, prefix reuse off
and fresh prompts per run (no cache hit timed). Ratios are against the plain run measured in the same process.

    python benchmarks/logit_controls.py --batch_size 8 --max_new_tokens 64 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from importlib import resources

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import default_checkpoint_dir

CONTROLS = dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={11: 1.0})


def prompts(n: int, offset: int) -> list[str]:
    lines = resources.files("thunder_batch.data").joinpath("prompts.jsonl").read_text().splitlines()
    texts = [json.loads(line)["prompt"] for line in lines]
    return [f"({offset + i}) {texts[(offset + i) % len(texts)]}" for i in range(n)]


def timed(engine: Engine, batch: list[str], params: list[SamplingParams]) -> float:
    """Generated tokens per second."""
    start = time.perf_counter()
    results = engine.generate(batch, params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", default="thunder")
    args = parser.parse_args()
    print("# " + subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True).stdout.strip())
    config = EngineConfig(
        compile=args.compile, batch_size=args.batch_size, max_seq_length=512, prefix_reuse=False, prefill_chunk=32
    )
    engine = Engine.from_checkpoint(default_checkpoint_dir(), config)
    engine.warmup()
    plain = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    controlled = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True, **CONTROLS)
    B = args.batch_size
    runs = {"plain": [plain] * B, "one row controlled": [controlled] + [plain] * (B - 1)}
    runs["all controlled"] = [controlled] * B
    timed(engine, prompts(B, 10_000), runs["all controlled"])  # the controlled heads made before timing
    rates: dict[str, list[float]] = {name: [] for name in runs}
    offset = 0
    for _ in range(args.rounds):
        for name, params in runs.items():
            offset += B
            rates[name].append(timed(engine, prompts(B, offset), params))
    best = {name: max(r) for name, r in rates.items()}
    for name, rate in best.items():
        each = [round(r, 1) for r in rates[name]]
        print(f"B={B} {name}: {rate:.1f} tok/s ({rate / best['plain']:.3f}x plain), runs {each}")


if __name__ == "__main__":
    main()
