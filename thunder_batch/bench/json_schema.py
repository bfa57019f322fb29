"""`thunder-batch bench --dataset json-schema`: structured output's cost and its forced tokens. N chat requests,
each a JSON schema and a prompt asking for it (fresh: each names its own item), go through one engine per (system,
batch size, variant), all at once: json_schema with forced tokens off (one step a token), free (the same prompts,
no schema, each request made to give as many tokens as its JSON answer: like for like), json_schema with forced
tokens always fed at once, and with the default gate (where measured step times say it pays: forced.py). Per run:
generated tokens per second, the decode steps' median time, steps, the answers that parse (the best of `--repeats`
runs, the variants in turn); the ratios to free; whether forced tokens gave every request the tokens of one step
each. With a llama.cpp build and GGUF
(`--llama_cpp_bin`, `--llama_cpp_gguf`: the same weights), llama-server runs the same requests free and with
`json_schema` at each batch size."""

from __future__ import annotations

import json
import statistics
import sys
import time

from thunder_batch.bench.options import BenchOptions

NAME = {"type": "string", "maxLength": 20}
INT = {"type": "integer", "minimum": 0, "maximum": 100000}
YES_NO = {"type": "boolean"}
# (what the prompt asks to describe, its fields): every field bounded and required (fixed keys), so a small model
# cannot run on to max_tokens inside a value.
KINDS = [
    ("a city", dict(name=NAME, country=NAME, population=INT, coastal=YES_NO)),
    ("a book", dict(title=NAME, author=NAME, year=INT, genre={"enum": ["fiction", "science", "history"]})),
    ("a person", dict(name=NAME, age={"type": "integer", "minimum": 0, "maximum": 120}, job=NAME)),
    (
        "a product",
        dict(name=NAME, price={"type": "number", "minimum": 0, "maximum": 1000}, in_stock={"type": "boolean"}),
    ),
    (
        "a meal",
        dict(
            dish=NAME,
            calories=INT,
            vegetarian={"type": "boolean"},
            tags={"type": "array", "items": NAME, "maxItems": 3},
        ),
    ),
    ("a trip", dict(origin=NAME, destination=NAME, days={"type": "integer", "minimum": 1, "maximum": 60})),
]
# variant -> EngineConfig.forced_tokens; "json_schema" runs first: "free" then asks each request for as many tokens
VARIANTS = {"json_schema": False, "free": False, "json_schema+forced": True, "json_schema+gate": None}


def schema_requests(num_requests: int) -> list[tuple[str, dict]]:
    """(user message, schema) per request; each message names its own item number (no prefix is a cache hit)."""
    out = []
    for i in range(num_requests):
        what, fields = KINDS[i % len(KINDS)]
        schema = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
        out.append((f"Item {i}: describe {what} as JSON.", schema))
    return out


def run_variant(engine, prompts, schemas, variant: str, lengths: list[int] | None, max_new_tokens: int) -> dict:
    """Every request at once through `engine`; its decode-only steps timed apart (observers). "free": no schema,
    each request made to give `lengths[i]` tokens (its constrained answer's), so both runs generate as much."""
    from thunder_batch.config import SamplingParams

    if variant == "free":  # token ids: no chat stop tokens, so each request gives its length
        prompts = [engine.encode(p) for p in prompts]
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    else:
        params = [SamplingParams(max_new_tokens=max_new_tokens, json_schema=s) for s in schemas]
    decode_s: list[float] = []  # steps whose every slot fed one token

    def timed(event) -> None:
        if all(len(w.token_ids) == 1 for w in event.plan.work):
            decode_s.append(event.seconds)

    watch = engine.observers.add(timed)
    steps = engine.stats()["steps"]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    engine.observers.remove(watch)
    generated = sum(len(r.token_ids) for r in results)
    return dict(
        variant=variant,
        tok_s=round(generated / wall, 2),
        decode_step_ms=round(statistics.median(decode_s) * 1e3, 2) if decode_s else None,
        steps=engine.stats()["steps"] - steps,
        generated_tokens=generated,
        parsed=sum(_parses(r.text) for r in results),
        tokens=[r.token_ids for r in results],
    )


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def engine_rows(gpt, tokenizer, prompts, schemas, systems: dict, base: dict, options: BenchOptions) -> list[dict]:
    """One row per (system, B, variant), with its ratios to free at the same system and B: the variants' engines
    run in turn `repeats` times (this machine's noise), each keeping its best run."""
    rows = []
    for name, overrides in systems.items():
        for batch_size in [int(b) for b in str(options.batch_size).split(",")]:
            fields = dict(
                base, **overrides, batch_size=batch_size, prefill_lanes=min(base["prefill_lanes"], batch_size)
            )
            engines = {v: _engine(gpt, tokenizer, fields, forced, prompts, schemas) for v, forced in VARIANTS.items()}
            runs, lengths = {}, None
            for _ in range(max(1, options.repeats)):
                for variant, engine in engines.items():
                    run = run_variant(engine, prompts, schemas, variant, lengths, options.max_new_tokens)
                    lengths = lengths or [max(1, len(t)) for t in run["tokens"]]
                    runs[variant] = _best(runs.get(variant), run)
            del engines
            rows += [_row(name, batch_size, run, runs) for run in runs.values()]
            for row in rows[-len(VARIANTS) :]:
                print(f"[json-schema bench] {json.dumps(row)}", file=sys.stderr)
    return rows


def _engine(gpt, tokenizer, fields: dict, forced, prompts, schemas):
    """An engine of these EngineConfig fields, warmed up, its controlled heads made."""
    from thunder_batch.config import EngineConfig, SamplingParams
    from thunder_batch.engine import Engine

    engine = Engine(gpt, EngineConfig(**fields, forced_tokens=forced), tokenizer=tokenizer)
    engine.warmup()
    batch = fields["batch_size"]
    engine.generate(prompts[:batch], [SamplingParams(max_new_tokens=4, json_schema=s) for s in schemas[:batch]])
    return engine


def _best(kept: dict | None, run: dict) -> dict:
    """The faster of two runs of a variant, with the shorter of their decode steps' medians."""
    if kept is None:
        return run
    best = dict(max(kept, run, key=lambda r: r["tok_s"]))
    steps = [r["decode_step_ms"] for r in (kept, run) if r["decode_step_ms"] is not None]
    best["decode_step_ms"] = min(steps) if steps else None
    return best


def _row(system: str, batch_size: int, run: dict, runs: dict) -> dict:
    free = runs["free"]
    row = dict(system=system, batch_size=batch_size, **{k: v for k, v in run.items() if k != "tokens"})
    row["tok_s_x_free"] = round(run["tok_s"] / free["tok_s"], 3)
    if run["decode_step_ms"] and free["decode_step_ms"]:
        row["decode_speed_x_free"] = round(free["decode_step_ms"] / run["decode_step_ms"], 3)
    if run["variant"].startswith("json_schema+"):
        row["tokens_equal_to_one_step_each"] = run["tokens"] == runs["json_schema"]["tokens"]
    return row


def llama_cpp_rows(prompt_ids: list[list[int]], schemas, options: BenchOptions, max_seq_length: int) -> list[dict]:
    """llama-server on the first of --llama_cpp_gguf with B slots, free then with `json_schema`, greedy, prompts as
    token ids, no prompt cache; one row per (B, variant)."""
    from types import SimpleNamespace

    from thunder_batch.bench.llama_cpp import server_path, start_server

    server, gguf = server_path(options.llama_cpp_bin), options.llama_cpp_gguf.split(",")[0]
    rows = []
    for batch_size in [int(b) for b in str(options.batch_size).split(",")]:
        process, url = start_server(server, gguf, batch_size, SimpleNamespace(max_seq_length=max_seq_length))
        try:
            runs = {"json_schema": _llama_variant(url, prompt_ids, schemas, None, options.max_new_tokens)}
            runs["free"] = _llama_variant(url, prompt_ids, schemas, runs["json_schema"].pop("lengths"), 0)
            runs["free"].pop("lengths")
        finally:
            process.terminate()
            process.wait(timeout=30)
        for run in runs.values():
            rows.append(dict(system="llama.cpp", batch_size=batch_size, gguf=gguf, **run))
            rows[-1]["tok_s_x_free"] = round(run["tok_s"] / runs["free"]["tok_s"], 3)
            print(f"[json-schema bench] {json.dumps(rows[-1])}", file=sys.stderr)
    return rows


def _llama_variant(url: str, prompt_ids, schemas, lengths: list[int] | None, max_new_tokens: int) -> dict:
    """Every request at once on its own connection: with its `json_schema`, or (lengths given) free, each request
    made to give lengths[i] tokens. Tokens per second over the run, answers that parse, each answer's length."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    def one(i: int) -> dict:
        body = dict(prompt=prompt_ids[i], temperature=0.0, cache_prompt=False)
        if lengths is None:
            body.update(json_schema=schemas[i], n_predict=max_new_tokens)
        else:
            body.update(n_predict=lengths[i], ignore_eos=True)
        response = requests.post(f"{url}/completion", json=body, timeout=3600)
        response.raise_for_status()
        return response.json()

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        answers = list(pool.map(one, range(len(prompt_ids))))
    wall = time.perf_counter() - start
    counts = [a.get("tokens_predicted", 0) for a in answers]
    parsed = sum(_parses(a.get("content", "")) for a in answers)
    variant = "free" if lengths is not None else "json_schema"
    return dict(
        variant=variant,
        tok_s=round(sum(counts) / wall, 2),
        generated_tokens=sum(counts),
        parsed=parsed,
        lengths=[max(1, n) for n in counts],
    )


def run_json_schema_benchmark(gpt, tokenizer, prompt_style, options: BenchOptions) -> list[dict]:
    """`bench --dataset json-schema`: the engine systems of `systems` (thunder-default when none is named) at each
    batch size of --batch_size, each variant; llama-server beside them when a build and GGUF are given. Prints one
    JSON row per run, writes them all to --output_json."""
    from thunder_batch.bench.llama_cpp import server_path
    from thunder_batch.bench.prefix_run import named_engine_systems
    from thunder_batch.bench.report import machine_info, write_json
    from thunder_batch.chat import apply_chat

    systems = named_engine_systems(options)
    asks = schema_requests(options.num_requests)
    prompts, schemas = [[dict(role="user", content=text)] for text, _ in asks], [s for _, s in asks]
    prompt_ids = [tokenizer.encode(apply_chat(prompt_style, p)).tolist() for p in prompts]
    max_seq_length = options.max_seq_length or max(map(len, prompt_ids)) + options.max_new_tokens
    base = dict(max_seq_length=max_seq_length, prefill_chunk=options.prefill_chunk, prefill_lanes=options.prefill_lanes)
    rows = engine_rows(gpt, tokenizer, prompts, schemas, systems, dict(base, prefix_reuse=False), options)
    if server_path(options.llama_cpp_bin) is not None and options.llama_cpp_gguf:
        rows += llama_cpp_rows(prompt_ids, schemas, options, max_seq_length)
    else:
        print("[json-schema bench] llama.cpp skipped: give --llama_cpp_bin and --llama_cpp_gguf", file=sys.stderr)
    print(json.dumps(rows, indent=1))
    if options.output_json:
        meta = dict(machine_info(gpt.transformer.wte.weight.device), command=" ".join(sys.argv))
        write_json(dict(dataset="json-schema", num_requests=len(prompts), results=rows, meta=meta), options.output_json)
    return rows
