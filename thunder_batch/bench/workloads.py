"""Benchmark workloads: which token ids each request sends, how many tokens it asks for, and when.

Three datasets: `prompts` (the shipped real prompts in data/prompts.jsonl, rendered through the
model's chat prompt style), `grounded` (data/grounded.jsonl: chat prompts holding a passage to repeat,
summarize or edit, where speculative decoding's prompt lookup finds its drafts) and `random` (random
token ids). Prompt and output lengths come from
seeded distributions; arrival times are all 0 (offline) or a Poisson process (online).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from importlib import resources

DATASETS = ("prompts", "random", "grounded")


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the start of the run


def load_prompts(dataset: str = "prompts") -> list[str]:
    """The shipped prompts of a dataset: "prompts" (questions and instructions, short and long) or
    "grounded" (a passage to repeat, summarize or edit)."""
    text = resources.files("thunder_batch").joinpath(f"data/{dataset}.jsonl").read_text(encoding="utf-8")
    return [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]


def uniform_lengths(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(n)]


def output_lengths(rng: random.Random, n: int, max_new_tokens: int, range_ratio: float) -> list[int]:
    """Uniform in [max_new_tokens * (1 - range_ratio), max_new_tokens], at least 1."""
    low = max(1, math.floor(max_new_tokens * (1 - range_ratio)))
    return uniform_lengths(rng, n, low, max_new_tokens)


def poisson_arrivals(rng: random.Random, n: int, request_rate: float) -> list[float]:
    """Arrival offsets of a Poisson process at `request_rate` requests/s (all 0 when infinite)."""
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (inf for offline), got {request_rate}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(request_rate)
        out.append(t)
    return out


def random_prompts(rng: random.Random, n: int, input_len: int, range_ratio: float, vocab_size: int) -> list[list[int]]:
    """Random token ids, lengths uniform in [input_len * (1 - r), input_len * (1 + r)]."""
    low = max(1, math.floor(input_len * (1 - range_ratio)))
    high = max(low, math.ceil(input_len * (1 + range_ratio)))
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in uniform_lengths(rng, n, low, high)]


def real_prompts(rng: random.Random, n: int, encode, dataset: str = "prompts") -> list[list[int]]:
    """n of the shipped prompts in a seeded order (cycled when n is larger), as token ids via `encode`."""
    texts = load_prompts(dataset)
    rng.shuffle(texts)
    return [list(encode(texts[i % len(texts)])) for i in range(n)]


def build_workload(
    dataset: str,
    num_requests: int,
    max_new_tokens: int,
    *,
    seed: int = 0,
    input_len: int = 128,
    range_ratio: float = 0.5,
    request_rate: float = math.inf,
    vocab_size: int | None = None,
    encode=None,
    max_seq_length: int | None = None,
) -> list[BenchRequest]:
    """The requests of one benchmark run; every system gets exactly these.

    encode(text) -> token ids is needed for the `prompts` dataset, vocab_size for `random`.
    With max_seq_length, prompts are cut (keeping their end) so prompt + output fits.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset must be one of {DATASETS}, got {dataset!r}")
    if num_requests < 1 or max_new_tokens < 1 or not 0 <= range_ratio < 1:
        raise ValueError("need num_requests >= 1, max_new_tokens >= 1 and 0 <= range_ratio < 1")
    rng = random.Random(seed)
    if dataset == "random":
        if vocab_size is None:
            raise ValueError("the random dataset needs vocab_size")
        prompts = random_prompts(rng, num_requests, input_len, range_ratio, vocab_size)
    else:
        if encode is None:
            raise ValueError("the prompts dataset needs a tokenizer (encode); use --dataset random without one")
        prompts = real_prompts(rng, num_requests, encode, dataset)
    outputs = output_lengths(rng, num_requests, max_new_tokens, range_ratio)
    arrivals = poisson_arrivals(rng, num_requests, request_rate)
    if max_seq_length is not None:
        prompts = [p[-(max_seq_length - n) :] for p, n in zip(prompts, outputs)]
    return [BenchRequest(i, tuple(p), n, a) for i, (p, n, a) in enumerate(zip(prompts, outputs, arrivals))]


def fitted_max_seq_length(workload: list[BenchRequest], multiple: int = 64) -> int:
    """The smallest multiple of `multiple` that holds every request's prompt + output."""
    need = max(len(r.prompt_ids) + r.max_new_tokens for r in workload)
    return multiple * math.ceil(need / multiple)


def same_length_groups(workload: list[BenchRequest], batch_size: int) -> list[list[BenchRequest]]:
    """Requests grouped by prompt length (litgpt's batched_generate_fn needs equal lengths), each group
    split into batches of at most `batch_size`, in order of first appearance."""
    by_len: dict[int, list[BenchRequest]] = {}
    for r in workload:
        by_len.setdefault(len(r.prompt_ids), []).append(r)
    return [g[i : i + batch_size] for g in by_len.values() for i in range(0, len(g), batch_size)]


def describe(workload: list[BenchRequest]) -> dict:
    plens = [len(r.prompt_ids) for r in workload]
    outs = [r.max_new_tokens for r in workload]
    return dict(
        num_requests=len(workload),
        prompt_len_min=min(plens),
        prompt_len_max=max(plens),
        prompt_len_mean=sum(plens) / len(plens),
        max_new_tokens_min=min(outs),
        max_new_tokens_max=max(outs),
        max_new_tokens_mean=sum(outs) / len(outs),
        distinct_prompt_lengths=len(set(plens)),
        last_arrival_s=max(r.arrival_s for r in workload),
    )
