"""`thunder-batch generate`: stream several prompts through one engine and print them labelled."""

from __future__ import annotations

import resource
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from thunder_batch.cli.options import EngineOptions


def generate(
    prompt: list[str] | None = None,
    chat: list[str] | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    repetition_penalty: float = 1.0,
    frequency_penalty: float = 0.0,
    presence_penalty: float = 0.0,
    min_p: float = 0.0,
    **options,
) -> None:
    """Generate text for several prompts at once, streaming each as it is produced.

    Args:
        prompt: Raw text prompts (repeat the flag for several).
        chat: User messages, each sent as a one-turn chat through the model's prompt style.
        max_new_tokens: Most tokens generated per prompt.
        temperature: 0 is greedy decoding.
        top_k: Keep only the k most likely tokens (None: off).
        top_p: Nucleus sampling mass in (0, 1] (1: off).
        seed: Seed for sampling; the same seed gives the same text whatever the batch.
        stop: Stop strings (repeat the flag for several); the stop text is not printed.
        repetition_penalty: > 1 makes tokens of the prompt and output less likely (1: off).
        frequency_penalty: In [-2, 2]: subtracted from a token's logit per time it was generated.
        presence_penalty: In [-2, 2]: subtracted from the logit of every token generated at least once.
        min_p: Sample only tokens at least this likely relative to the most likely (0: off).
    """
    from thunder_batch import SamplingParams

    prompts = list(prompt or []) + [[{"role": "user", "content": c}] for c in chat or []]
    if not prompts:
        raise SystemExit("thunder-batch generate: give at least one --prompt or --chat")
    try:
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop=list(stop or []),
            repetition_penalty=repetition_penalty,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            min_p=min_p,
        )
    except ValueError as e:  # a bad setting, before the model loads
        raise SystemExit(f"thunder-batch generate: {e}") from e
    err = Console(stderr=True)
    start = time.perf_counter()
    engine = EngineOptions(**options).load_engine()
    err.print(f"loaded model in {time.perf_counter() - start:.1f}s")
    try:
        ids = [engine.add_request(p, params) for p in prompts]
    except ValueError as e:
        raise SystemExit(f"thunder-batch generate: {e}") from e
    labels = {rid: _label(i, p) for i, (rid, p) in enumerate(zip(ids, prompts))}
    start = time.perf_counter()
    texts = _stream(engine, labels, Console())
    # Step shapes are made on first use: only those these prompts need (a server makes all up front).
    compile_s = engine.stats()["compile_seconds"]
    _report(err, engine, texts, compile_s, time.perf_counter() - start - compile_s)


def _label(index: int, prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    return f"[{index + 1}] {text[:60]}" + ("…" if len(text) > 60 else "")


def _stream(engine, labels: dict, out: Console) -> dict:
    """Live panels on a terminal; plain labelled blocks, each printed when done, otherwise."""
    texts = {rid: "" for rid in labels}
    reasons = {}

    def render():
        return Group(*(Panel(Text(texts[r]), title=labels[r], subtitle=reasons.get(r)) for r in labels))

    with Live(render(), console=out, refresh_per_second=8, transient=False) if out.is_terminal else _NoLive() as live:
        while engine.has_unfinished():
            for o in engine.step():
                texts[o.request_id] += o.text or ""
                if o.finished:
                    reasons[o.request_id] = o.finish_reason
                    if not out.is_terminal:
                        print(
                            f"{labels[o.request_id]}\n{texts[o.request_id]}\n(finish: {o.finish_reason})\n", flush=True
                        )
            if live is not None:
                live.update(render())
    return texts


class _NoLive:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _report(err: Console, engine, texts: dict, compile_s: float, elapsed: float) -> None:
    stats = engine.stats()
    tokens = stats["generated_tokens"]
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rate = tokens / max(elapsed, 1e-9)
    err.print(
        f"{len(texts)} prompts, {tokens} tokens in {elapsed:.2f}s ({rate:.1f} tokens/s), {stats['steps']} steps; "
        f"compile {compile_s:.1f}s ({stats['traced']} pieces traced, {stats['disk_cache_hits']} from disk); "
        f"peak RSS {peak_rss_mb:.0f} MiB"
    )
    print(file=sys.stderr, flush=True)
