"""Structured output's cost: B requests with a JSON schema against the same requests free, on the default model
(compiled, prefix reuse off, fresh prompts every run, alternating): generated tokens per second over the run (a
JSON answer is shorter than a free one, so its prompt step weighs more), the decode steps' median time (the
like-for-like number), and what the grammar work takes per row and token (mask and advance, on the engine's thread
before the step).

    python benchmarks/structured_output.py --batches 1,8 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import default_checkpoint_dir

NAME = {"type": "string", "maxLength": 24}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": NAME,
        "country": NAME,
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "coastal": {"type": "boolean"},
        "landmarks": {"type": "array", "items": NAME, "maxItems": 3},
    },
    "required": ["name", "country", "population", "coastal", "landmarks"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Lyon", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Rome", "Nice", "Kyiv"]


def chats(n: int, offset: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"({offset + i}) Describe {CITIES[(offset + i) % len(CITIES)]} as JSON."}]
        for i in range(n)
    ]


def timed(engine: Engine, prompts: list, params: SamplingParams) -> tuple[float, float]:
    """(generated tokens per second, median seconds of its decode-only steps)."""
    steps = []
    watch = engine.observers.add(lambda event: steps.append(event.seconds) if not event.shape.lanes else None)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    engine.observers.remove(watch)
    return rate, statistics.median(steps)


def grammar_us_per_row(engine: Engine) -> float:
    """Microseconds a row's mask + advance take, timed alone over one constrained answer's tokens."""
    import numpy as np

    params = SamplingParams(max_new_tokens=64, json_schema=SCHEMA)
    tokens = engine.generate(chats(1, 99), params)[0].token_ids
    [request] = engine.prepare(chats(1, 99)[0], params)
    row = np.zeros(-(-engine.vocab_size // 32), dtype=np.int32)
    start = time.perf_counter()
    for token in tokens:
        request.constraint.fill(row)
        request.constraint.advance([token])
    return (time.perf_counter() - start) / max(len(tokens), 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--compile", default="thunder")
    args = parser.parse_args()
    print("# " + subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True).stdout.strip())
    batches = [int(b) for b in args.batches.split(",")]
    config = EngineConfig(
        compile=args.compile, batch_size=max(batches), max_seq_length=512, prefix_reuse=False, prefill_chunk=32
    )
    engine = Engine.from_checkpoint(default_checkpoint_dir(), config)
    engine.warmup()
    free = SamplingParams(max_new_tokens=args.max_new_tokens)
    constrained = SamplingParams(max_new_tokens=args.max_new_tokens, json_schema=SCHEMA)
    engine.generate(chats(max(batches), 500), constrained)  # the controlled heads made before timing
    offset = 1000
    for B in batches:
        rates, steps = {"free": [], "json_schema": []}, {"free": [], "json_schema": []}
        for _ in range(args.rounds):
            for name, params in (("free", free), ("json_schema", constrained)):
                offset += B
                rate, step_s = timed(engine, chats(B, offset), params)
                rates[name].append(rate)
                steps[name].append(step_s * 1e3)
        ratio = max(rates["json_schema"]) / max(rates["free"])
        fast = {name: min(ms) for name, ms in steps.items()}
        print(
            f"B={B}: free {max(rates['free']):.1f} tok/s, json_schema {max(rates['json_schema']):.1f} tok/s "
            f"({ratio:.3f}x free); decode step ms free {fast['free']:.1f}, json_schema {fast['json_schema']:.1f} "
            f"({fast['free'] / fast['json_schema']:.3f}x free's speed); "
            f"runs {json.dumps({k: [round(r, 1) for r in v] for k, v in rates.items()})}"
        )
    print(f"grammar work per constrained row and token: {grammar_us_per_row(engine):.0f} us (mask + advance)")


if __name__ == "__main__":
    main()
