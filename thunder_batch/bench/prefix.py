"""Prompt prefixes read once: the `multi-turn` and `shared-prefix` workloads, each run with prefix reuse
off and on in one process, on the same weights, prompts and step program (the second engine of a Thunder
system loads the first one's compile cache), plus a control workload without shared prefixes.

- multi-turn: conversations of `turns` turns, all at once; each turn sends the whole conversation so
  far (every earlier prompt and reply) and `turn_len` new user token ids, as a chat client does.
- shared-prefix: `num_requests` requests submitted at once, each a `system_len`-token system prompt
  (the same for all) and its own question.
- control: prompts of the shared-prefix sizes without a shared token: reuse must change nothing.

Greedy decoding, every output token checked equal between off and on; prompt tokens computed and reused
are the engine's own counters; time to first token is measured from the request's submission.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

from thunder_batch.config import SamplingParams
from thunder_batch.observe import StepEvent

PREFIX_DATASETS = ("multi-turn", "shared-prefix")
QUESTION_LEN = 40  # shared-prefix: each request's own tokens after the system prompt


@dataclass(frozen=True)
class PrefixBench:
    """What one run measures (token lists are built once and shared by every system)."""

    dataset: str
    batch_size: int
    max_new_tokens: int
    turns: list[list[list[int]]]  # multi-turn: per conversation, each turn's new user tokens
    prompts: list[list[int]]  # shared-prefix: each request's whole prompt
    control: list[list[int]]  # the same sizes, nothing shared
    unique_tokens: int  # prompt tokens a perfect cache computes once (shared-prefix)


def token_pool(rng, encode, vocab_size: int, n: int) -> list[int]:
    """n token ids of real text (the shipped prompts, encoded and joined), or random ids without a tokenizer."""
    from thunder_batch.bench.workloads import load_prompts

    if encode is None:
        return [rng.randrange(vocab_size) for _ in range(n)]
    texts, pool = load_prompts(), []
    rng.shuffle(texts)
    for i in itertools.count():
        if len(pool) >= n:
            return pool[:n]
        pool += [int(t) for t in encode(texts[i % len(texts)])]


def build_prefix_bench(
    dataset: str,
    num_requests: int,
    max_new_tokens: int,
    batch_size: int,
    *,
    turns: int = 8,
    turn_len: int = 40,
    system_len: int = 500,
    question_len: int = QUESTION_LEN,
    seed: int = 0,
    encode=None,
    vocab_size: int = 0,
) -> PrefixBench:
    import random

    if dataset not in PREFIX_DATASETS:
        raise ValueError(f"dataset must be one of {PREFIX_DATASETS}, got {dataset!r}")
    rng = random.Random(seed)
    if dataset == "multi-turn":
        pool = token_pool(rng, encode, vocab_size, num_requests * turns * turn_len)
        chunks = [pool[i : i + turn_len] for i in range(0, len(pool), turn_len)]
        conversations = [chunks[c * turns : (c + 1) * turns] for c in range(num_requests)]
        return PrefixBench(dataset, batch_size, max_new_tokens, conversations, [], [], 0)
    pool = token_pool(rng, encode, vocab_size, system_len + 2 * num_requests * question_len)
    system, rest = pool[:system_len], pool[system_len:]
    questions = [rest[i * question_len : (i + 1) * question_len] for i in range(num_requests)]
    prompts = [system + q for q in questions]
    control_pool = token_pool(random.Random(seed + 1), None, vocab_size or 1000, num_requests * len(prompts[0]))
    control = [control_pool[i * len(prompts[0]) : (i + 1) * len(prompts[0])] for i in range(num_requests)]
    control = [[i] + p[1:] for i, p in enumerate(control)]  # first tokens differ: nothing shared
    return PrefixBench(
        dataset, batch_size, max_new_tokens, [], prompts, control, system_len + num_requests * question_len
    )


def drive_conversations(engine, conversations: list[list[list[int]]], max_new_tokens: int) -> list[list[dict]]:
    """Every conversation's turns, each sent when its previous reply is done: per conversation, per turn,
    its prompt length, reply tokens and time to first token (from its submission)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    records = [[] for _ in conversations]
    transcripts = [[] for _ in conversations]
    live = {}  # request id -> (conversation, record)

    def send(c: int) -> None:
        prompt = transcripts[c] + conversations[c][len(records[c])]
        record = dict(prompt_tokens=len(prompt), tokens=[], sent=time.perf_counter(), ttft_s=None)
        records[c].append(record)
        transcripts[c] = prompt
        live[engine.add_request(prompt, params)] = (c, record)

    for c in range(len(conversations)):
        send(c)
    while live:
        for out in engine.step():
            c, record = live[out.request_id]
            if record["ttft_s"] is None and out.token_ids:
                record["ttft_s"] = time.perf_counter() - record["sent"]
            record["tokens"] += out.token_ids
            if out.finished:
                del live[out.request_id]
                transcripts[c] = transcripts[c] + record["tokens"]
                if len(records[c]) < len(conversations[c]):
                    send(c)
    return records


def drive_burst(engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """All prompts submitted at once: per request its reply tokens and time to first token."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    records = {i: dict(tokens=[], ttft_s=None) for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            record = records[out.request_id]
            if record["ttft_s"] is None and out.token_ids:
                record["ttft_s"] = time.perf_counter() - start
            record["tokens"] += out.token_ids
    return [records[i] for i in ids]


class ScheduleTimer:
    """Seconds the engine's scheduler spends planning (admission and prefix matching are host work), and
    every plan as (request, first position, tokens) per fed request: which request goes when (an observer:
    `Engine.observers`)."""

    def __init__(self) -> None:
        self.seconds, self.plans = 0.0, []

    def __call__(self, event: StepEvent) -> None:
        self.seconds += event.schedule_seconds
        self.plans.append(sorted((w.request.request_id, w.start_pos, len(w.token_ids)) for w in event.plan.work))


def run_once(engine, bench: PrefixBench, workload: str) -> dict:
    timer = engine.observers.add(ScheduleTimer())
    start, before = time.perf_counter(), engine.stats()
    if workload == "multi-turn":
        records = drive_conversations(engine, bench.turns, bench.max_new_tokens)
    else:
        records = drive_burst(
            engine, bench.prompts if workload == "shared-prefix" else bench.control, bench.max_new_tokens
        )
    wall, stats = time.perf_counter() - start, engine.stats()
    engine.observers.remove(timer)
    counted = ("steps", "prompt_tokens", "prompt_tokens_computed", "prompt_tokens_reused", "generated_tokens")
    return dict(
        wall_s=wall,
        schedule_s=timer.seconds,
        plans=numbered_from_zero(timer.plans),
        records=records,
        **{k: stats[k] - before[k] for k in counted},
        cache_misses=stats["cache_misses"],
    )


def numbered_from_zero(plans: list) -> list:
    """Plans with request ids counted from the run's first (ids are consecutive within a run, so runs of
    the same workload on different engines or repeats compare)."""
    first = min((rid for plan in plans for rid, _, _ in plan), default=0)
    return [[(rid - first, pos, n) for rid, pos, n in plan] for plan in plans]


def compare(workload: str, bench: PrefixBench, off: dict, on: dict) -> dict:
    """The issue's ratios, from two runs of one workload."""
    tokens = lambda run: [r["tokens"] for r in _flat(run["records"])]  # noqa: E731
    out = dict(
        tokens_equal=tokens(off) == tokens(on),
        steps=(off["steps"], on["steps"]),
        wall_s=(off["wall_s"], on["wall_s"]),
        wall_on_over_off=on["wall_s"] / off["wall_s"],
        schedule_s=(off["schedule_s"], on["schedule_s"]),
        same_plans=off["plans"] == on["plans"],  # the same requests fed the same tokens at every step
        # planning time reuse adds, as a share of the run without it (the steps themselves are the same work
        # when nothing is shared: same plans, same shapes)
        schedule_added_share=(on["schedule_s"] - off["schedule_s"]) / off["wall_s"],
        prompt_tokens_computed=(off["prompt_tokens_computed"], on["prompt_tokens_computed"]),
        prompt_tokens_reused=on["prompt_tokens_reused"],
        computed_on_over_off=on["prompt_tokens_computed"] / max(off["prompt_tokens_computed"], 1),
        cache_misses=(off["cache_misses"], on["cache_misses"]),
    )
    if workload == "multi-turn":
        last = [statistics.mean(conv[t]["ttft_s"] for conv in run["records"]) for run in (off, on) for t in [-1]]
        out.update(
            ttft_by_turn_s=[
                [statistics.mean(conv[t]["ttft_s"] for conv in run["records"]) for t in range(len(bench.turns[0]))]
                for run in (off, on)
            ],
            last_turn_ttft_s=tuple(last),
            last_turn_ttft_off_over_on=last[0] / last[1],
        )
    else:
        p50 = [statistics.median(r["ttft_s"] for r in run["records"]) for run in (off, on)]
        out.update(ttft_p50_s=tuple(p50), ttft_p50_off_over_on=p50[0] / p50[1])
        if workload == "shared-prefix":
            out.update(
                unique_tokens=bench.unique_tokens,
                computed_over_unique=on["prompt_tokens_computed"] / bench.unique_tokens,
            )
    return out


def _flat(records) -> list[dict]:
    return [r for conv in records for r in conv] if records and isinstance(records[0], list) else list(records)
