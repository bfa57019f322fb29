"""`thunder-batch bench --dataset multi-turn / shared-prefix`: two engines per system (prefix reuse off
and on, same weights and compile cache), the workloads of `bench.prefix` on each, and the comparison."""

from __future__ import annotations

import sys

from thunder_batch.bench.options import BenchOptions
from thunder_batch.bench.prefix import QUESTION_LEN, PrefixBench, build_prefix_bench, compare, run_once
from thunder_batch.config import EngineConfig


def engine_pair(gpt, config: EngineConfig, tokenizer) -> dict:
    """Two engines on the same weights and compile cache, reuse off and on, each warmed up first."""
    import dataclasses

    from thunder_batch.engine import Engine

    engines = {}
    for reuse in (False, True):
        engines[reuse] = Engine(gpt, dataclasses.replace(config, prefix_reuse=reuse), tokenizer=tokenizer)
        seconds = engines[reuse].warmup()
        print(f"[prefix bench] warm-up ({'on' if reuse else 'off'}): {sum(seconds.values()):.1f}s", file=sys.stderr)
    return engines


def run_prefix_bench(gpt, tokenizer, bench: PrefixBench, systems: dict, base: EngineConfig, repeats: int = 1) -> dict:
    """Each system (name -> EngineConfig overrides), reuse off and on, on the dataset's workload and
    (shared-prefix) the control, `repeats` times each, off and on alternating (each run from a cache
    holding no prefix: `reset_prefix_cache`); the fastest run of each is compared. Returns the
    comparisons by system and workload."""
    import dataclasses

    workloads = [bench.dataset] + (["control"] if bench.dataset == "shared-prefix" else [])
    results = {}
    for name, overrides in systems.items():
        engines = engine_pair(gpt, dataclasses.replace(base, **overrides), tokenizer)
        runs = {w: {False: [], True: []} for w in workloads}
        for workload in workloads:
            for _ in range(repeats):
                for reuse, engine in engines.items():
                    engine.reset_prefix_cache()
                    runs[workload][reuse].append(run_once(engine, bench, workload))
                    wall = runs[workload][reuse][-1]["wall_s"]
                    print(f"[prefix bench] {name} {workload} reuse={reuse}: {wall:.1f}s", file=sys.stderr)
        fastest = {w: {r: min(runs[w][r], key=lambda run: run["wall_s"]) for r in (False, True)} for w in workloads}
        results[name] = {w: compare(w, bench, fastest[w][False], fastest[w][True]) for w in workloads}
        del engines
    return results


def run_prefix_benchmark(gpt, tokenizer, options: BenchOptions) -> dict:
    """`thunder-batch bench --dataset multi-turn|shared-prefix`: build the workload from the bench's
    options, run every engine system of `systems` off and on, print the comparison, write JSON."""
    import json

    from thunder_batch.bench.engine_runs import ENGINE_SYSTEMS
    from thunder_batch.bench.report import machine_info, write_json

    names = [n.split("@")[0] for n in options.systems.split(",") if n.split("@")[0] in ENGINE_SYSTEMS]
    systems = {n: engine_overrides(n, options.cache_dir) for n in names or ["eager"]}
    batch_size = int(str(options.batch_size).split(",")[0])
    encode = None if tokenizer is None else (lambda text: tokenizer.encode(text).tolist())
    multi = options.dataset == "multi-turn"
    bench = build_prefix_bench(
        options.dataset,
        options.num_requests,
        options.max_new_tokens,
        batch_size,
        turns=options.turns,
        turn_len=options.input_len,
        system_len=options.input_len,
        seed=options.seed,
        encode=encode,
        vocab_size=gpt.config.padded_vocab_size,
    )
    base = base_config(options, batch_size)
    results = run_prefix_bench(gpt, tokenizer, bench, systems, base, options.repeats)
    summary = dict(
        dataset=options.dataset,
        batch_size=batch_size,
        num_requests=options.num_requests,
        turns=options.turns if multi else None,
        input_len=options.input_len,
        max_new_tokens=options.max_new_tokens,
        max_seq_length=base.max_seq_length,
        repeats=options.repeats,
        precision=str(gpt.transformer.wte.weight.dtype).removeprefix("torch."),
        results=results,
        meta=dict(machine_info(gpt.transformer.wte.weight.device), command=" ".join(sys.argv)),
    )
    print(json.dumps(_headline(summary), indent=1))
    if options.output_json:
        write_json(summary, options.output_json)
    return summary


def base_config(options: BenchOptions, batch_size: int) -> EngineConfig:
    """The engine shape of the run; max_seq_length None: the longest prompt + reply, rounded up to 64."""
    import math

    if options.dataset == "multi-turn":
        need = options.turns * (options.input_len + options.max_new_tokens)
    else:
        need = options.input_len + QUESTION_LEN + options.max_new_tokens
    return EngineConfig(
        batch_size=batch_size,
        max_seq_length=options.max_seq_length or 64 * math.ceil(need / 64),
        prefill_chunk=options.prefill_chunk,
        prefill_lanes=min(options.prefill_lanes, batch_size),
        max_prefill_lanes=options.max_prefill_lanes,
        prefix_store_mb=options.prefix_store_mb,
    )


def engine_overrides(system: str, cache_dir) -> dict:
    """EngineConfig fields of an engine system of the benchmark (eager, or Thunder with its executors)."""
    from thunder_batch.bench.engine_runs import ENGINE_SYSTEMS

    executors = ENGINE_SYSTEMS[system]
    if executors is None:
        return dict(compile="eager")
    return dict(compile="thunder", executors=executors or None, cache_dir=None if cache_dir is None else str(cache_dir))


def named_engine_systems(options: BenchOptions) -> dict:
    """name -> EngineConfig overrides of the engine systems --systems names (thunder-default when it names none: the
    default list is not a choice), for the benches that run engines only (speculative, json-schema)."""
    from thunder_batch.bench.engine_runs import ENGINE_SYSTEMS
    from thunder_batch.bench.run_plan import ALL_SYSTEMS

    named = [] if options.systems == ",".join(ALL_SYSTEMS) else options.systems.split(",")
    names = [n.split("@")[0] for n in named if n.split("@")[0] in ENGINE_SYSTEMS] or ["thunder-default"]
    return {n: engine_overrides(n, options.cache_dir) for n in names}


def _headline(summary: dict) -> dict:
    """The comparison without per-turn lists (stdout)."""
    keep = lambda d: {k: v for k, v in d.items() if k != "ttft_by_turn_s"}  # noqa: E731
    return {name: {w: keep(c) for w, c in by_workload.items()} for name, by_workload in summary["results"].items()}
