"""Decode step cost vs max_seq_length: the attention-length ladder against reading the whole cache.

    python benchmarks/attention_ladder.py --batch-size 32 --live 200 --lengths 256,2048

Default model architecture (random weights, `--layers` of them), Thunder (torch executor defaults) or
eager. For each max_seq_length S, one engine with the default ladder (256, 512, ... S) and, for S above
the first, one that reads the whole cache (`attention_lengths=(S,)`, the behaviour before the ladder).
Every slot gets a `--live`-token prompt, then `--steps` decode steps are timed in alternating rounds
(all engines built first; their decode programs compiled by then). Prints the median ms per decode step,
each over the first S's ladder engine, and exits 1 unless every engine produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build(args, max_seq_length: int, rungs):
    import litgpt
    import torch

    from thunder_batch import Engine, EngineConfig, SamplingParams

    torch.manual_seed(0)
    gpt_config = litgpt.Config.from_name("SmolLM2-135M", n_layer=args.layers)
    config = EngineConfig(
        batch_size=args.batch_size,
        max_seq_length=max_seq_length,
        prefill_chunk=min(64, max_seq_length),
        prefill_lanes=min(8, args.batch_size),
        attention_lengths=rungs,
        compile=args.compile,
        cache_dir=args.cache_dir,
    )
    engine = Engine(litgpt.GPT(gpt_config).eval(), config)
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=max_seq_length - args.live, ignore_eos=True)
    for _ in range(args.batch_size):  # every slot busy, prompts of --live tokens (positions ~ live)
        engine.add_request(torch.randint(0, 1000, (args.live,), generator=g).tolist(), params)
    tokens = [[] for _ in range(args.batch_size)]
    while engine.scheduler.waiting or any(len(r.pending_ids()) > 1 for r in engine.scheduler.slots):
        record(engine, tokens)  # prefill
    record(engine, tokens)  # first decode step: compiles the decode program
    return engine, tokens


def record(engine, tokens) -> None:
    for out in engine.step():
        tokens[out.request_id].extend(out.token_ids)


def time_round(engine, tokens, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        record(engine, tokens)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--live", type=int, default=200, help="prompt tokens per slot")
    parser.add_argument("--lengths", default="256,2048", help="max_seq_length values; the first is the baseline")
    parser.add_argument("--rungs", default=None, help="ladder rungs (default: the engine's 256, 512, ...)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", default="thunder", choices=("thunder", "eager"))
    parser.add_argument("--cache-dir", default="/dev/null/none", help="compile cache (default: none)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rungs = None if args.rungs is None else tuple(int(x) for x in args.rungs.split(","))
    configs = [(f"S={S} ladder", S, rungs and tuple(r for r in rungs if r <= S)) for S in lengths]
    configs += [(f"S={S} whole cache", S, (S,)) for S in lengths[1:]]
    engines = {name: build(args, S, ladder) for name, S, ladder in configs}
    times = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (engine, tokens) in engines.items():
            times[name] += time_round(engine, tokens, args.steps)
    base = statistics.median(times[configs[0][0]])
    rows = {}
    for name, (engine, _) in engines.items():
        ms = 1000 * statistics.median(times[name])
        rows[name] = dict(ms=round(ms, 2), vs_first=round(ms / (1000 * base), 3), shapes=engine.stats()["step_shapes"])
        print(f"{name:<20} {ms:9.2f} ms/decode step  x{ms / (1000 * base):.3f}")
    reference = next(iter(engines.values()))[1]
    same = all(tokens == reference for _, tokens in engines.values())
    print(json.dumps(dict(batch_size=args.batch_size, live=args.live, compile=args.compile, rows=rows, same=same)))
    print("greedy tokens identical across engines: " + ("yes" if same else "NO"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
