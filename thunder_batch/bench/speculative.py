"""`thunder-batch bench --speculative_tokens 0,4,8`: the same requests through one engine per
(system, batch size, k), greedy; per run the decode rate, tokens per decode step, the drafts'
acceptance rate, whether every request's tokens equal those of k = 0 (speculative decoding is exact), and
the drafts' ceiling: the decode speedup if every draft were checked at no cost (k = 0's tokens against
prompt lookup's drafts), the most any gate or verify kernel could give on these requests."""

from __future__ import annotations

import heapq
import json
import sys
import time

from thunder_batch.bench.options import BenchOptions


def parse_ks(text) -> list[int]:
    """ "0,4,8" -> [0, 4, 8] (k = 0 first: the baseline every other k is compared with)."""
    ks = sorted({int(k) for k in str(text).split(",") if k.strip()})
    if not ks or ks[0] < 0:
        raise ValueError(f"speculative_tokens must be a comma list of ints >= 0, got {text!r}")
    return ks if ks[0] == 0 else [0, *ks]


def steps_if_every_draft_checked(prompt, output: list[int], k: int, ngram_min: int, ngram_max: int) -> int:
    """Decode steps of a request whose tokens are `output` (plain decoding's) if each step checked the
    draft prompt lookup proposes from what the request holds: each gives its accepted drafts and one token."""
    from thunder_batch.drafts import prompt_lookup

    done = steps = 0
    while done < len(output):
        draft = prompt_lookup(list(prompt) + output[:done], k, ngram_min, ngram_max) if k else []
        room = min(len(draft), len(output) - done - 1)  # the last token is always a step's own sample
        accepted = 0
        while accepted < room and draft[accepted] == output[done + accepted]:
            accepted += 1
        done, steps = done + accepted + 1, steps + 1
    return steps


def makespan(steps: list[int], batch_size: int) -> int:
    """Decode steps until the last request ends, each taking the first free of `batch_size` slots in order."""
    free = [0] * batch_size  # the step at which each slot is next free
    for n in steps:
        heapq.heapreplace(free, free[0] + n)
    return max(free)


def ceiling_speedup(prompts, outputs, k: int, ngram_min: int, ngram_max: int, batch_size: int) -> float:
    """The drafts' ceiling: decode steps of k = 0 over those with every draft checked, B slots taking the
    requests in order: the most speculative decoding can speed up decoding on these requests with
    these drafts, were verify steps free (at B > 1 the request with the fewest accepted drafts bounds it)."""
    plain = [len(output) for output in outputs]
    checked = [steps_if_every_draft_checked(p, o, k, ngram_min, ngram_max) for p, o in zip(prompts, outputs)]
    return makespan(plain, batch_size) / makespan(checked, batch_size)


def is_decode_plan(plan) -> bool:
    """Whether a step fed no prompt token but a slot's last: every slot fed one pending token (and its drafts)."""
    return all(len(w.token_ids) - len(w.draft) == 1 for w in plan.work)


def run_once(engine, workload, ignore_eos: bool) -> dict:
    """Every request of the workload at once, greedy; the decode steps timed apart."""
    from thunder_batch.config import SamplingParams

    requests = [
        engine.submit(list(r.prompt_ids), SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=ignore_eos))
        for r in workload
    ]
    steps = decode_steps = decode_tokens = 0
    decode_s = 0.0
    plans: list = []  # each step's plan, as the engine ran it
    watch = engine.observers.add(lambda event: plans.append(event.plan))
    start = time.perf_counter()
    while engine.has_unfinished():
        ran = len(plans)
        before = time.perf_counter()
        outputs = engine.step()
        if len(plans) > ran and is_decode_plan(plans[-1]):
            decode_s += time.perf_counter() - before
            decode_steps += 1
            decode_tokens += sum(len(o.token_ids) for o in outputs)
        steps += 1
    wall = time.perf_counter() - start
    engine.observers.remove(watch)
    return dict(
        wall_s=wall,
        steps=steps,
        generated_tokens=sum(len(r.output_ids) for r in requests),
        decode_steps=decode_steps,
        decode_tok_s=decode_tokens / decode_s if decode_s else 0.0,
        tokens_per_decode_step=decode_tokens / decode_steps if decode_steps else 0.0,
        tokens=[list(r.output_ids) for r in requests],
    )


def run_speculative_bench(
    gpt, tokenizer, workload, systems: dict, base: dict, ks: list[int], batch_sizes, options: BenchOptions
) -> list:
    """One row per (system, B, k): the run's numbers and its ratios to k = 0 at the same system and B.
    base: EngineConfig fields shared by every run."""
    from thunder_batch.config import EngineConfig
    from thunder_batch.engine import Engine

    rows, prompts = [], [r.prompt_ids for r in workload]
    for name, overrides in systems.items():
        for batch_size in batch_sizes:
            baseline = None
            for k in ks:
                lanes = min(base["prefill_lanes"], batch_size)
                fields = dict(base, prefill_lanes=lanes, batch_size=batch_size, speculative_tokens=k)
                config = EngineConfig(**fields, **overrides)
                engine = Engine(gpt, config, tokenizer=tokenizer)
                engine.warmup()
                run = run_once(engine, workload, options.ignore_eos)
                spec = engine.stats().get("speculative", {})
                baseline = baseline or run
                ngrams = (config.speculative_ngram_min, config.speculative_ngram_max)
                ceiling = ceiling_speedup(prompts, baseline["tokens"], k, *ngrams, batch_size)
                rows.append(_row(name, batch_size, k, run, spec, baseline) | dict(ceiling_speedup=round(ceiling, 3)))
                print(f"[speculative bench] {json.dumps(rows[-1])}", file=sys.stderr)
                del engine
    return rows


def _row(system: str, batch_size: int, k: int, run: dict, spec: dict, baseline: dict) -> dict:
    return dict(
        system=system,
        batch_size=batch_size,
        speculative_tokens=k,
        decode_tok_s=round(run["decode_tok_s"], 2),
        decode_speedup=round(run["decode_tok_s"] / baseline["decode_tok_s"], 3) if baseline["decode_tok_s"] else None,
        wall_s=round(run["wall_s"], 3),
        wall_speedup=round(baseline["wall_s"] / run["wall_s"], 3),
        tokens_per_decode_step=round(run["tokens_per_decode_step"], 3),
        acceptance_rate=round(spec["accepted_tokens"] / spec["draft_tokens"], 3) if spec.get("draft_tokens") else 0.0,
        verify_steps=spec.get("verify_steps", 0),
        steps=run["steps"],
        generated_tokens=run["generated_tokens"],
        tokens_equal_to_k0=run["tokens"] == baseline["tokens"],
    )


def run_speculative_benchmark(gpt, tokenizer, prompt_style, options: BenchOptions) -> list:
    """`bench` with --speculative_tokens other than 0: the dataset's workload (prompts, grounded or
    random) through the engine systems of `systems` (thunder-default when none is named), each batch
    size of --batch_size, each k; prints one JSON row per run, writes them all to --output_json."""
    from thunder_batch.bench.prefix_run import named_engine_systems
    from thunder_batch.bench.report import machine_info, write_json
    from thunder_batch.bench.run import make_workload

    systems = named_engine_systems(options)
    workload, max_seq_length = make_workload(gpt, tokenizer, prompt_style, options)
    base = dict(
        max_seq_length=max_seq_length,
        prefill_chunk=options.prefill_chunk,
        prefill_lanes=options.prefill_lanes,
        prefix_reuse=options.prefix_reuse,
    )
    batch_sizes = [int(b) for b in str(options.batch_size).split(",")]
    ks = parse_ks(options.speculative_tokens)
    rows = run_speculative_bench(gpt, tokenizer, workload, systems, base, ks, batch_sizes, options)
    print(json.dumps(rows, indent=1))
    if options.output_json:
        summary = dict(
            dataset=options.dataset,
            num_requests=len(workload),
            max_new_tokens=options.max_new_tokens,
            precision=str(gpt.transformer.wte.weight.dtype).removeprefix("torch."),
            results=rows,
            meta=dict(machine_info(gpt.transformer.wte.weight.device), command=" ".join(sys.argv)),
        )
        write_json(summary, options.output_json)
    return rows
