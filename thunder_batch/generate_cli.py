"""`thunder-batch generate`: stream several prompts through one engine and print them labelled."""

from __future__ import annotations

import resource
import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text


def run_generate(prompt, chat, checkpoint_dir, batch_size, max_seq_length, prefill_chunk, max_new_tokens,
                 temperature, top_k, top_p, seed, stop, compile, precision, cache_dir=None) -> None:
    import torch

    from thunder_batch import Engine, EngineConfig, SamplingParams

    prompts = list(prompt or []) + [[{"role": "user", "content": c}] for c in chat or []]
    if not prompts:
        raise SystemExit("thunder-batch generate: give at least one --prompt or --chat")
    err = Console(stderr=True)
    config = EngineConfig(batch_size=batch_size, max_seq_length=max_seq_length, prefill_chunk=prefill_chunk,
                          compile=compile, cache_dir=cache_dir)
    start = time.perf_counter()
    engine = Engine.from_checkpoint(checkpoint_dir, config, dtype=getattr(torch, precision))
    err.print(f"loaded model in {time.perf_counter() - start:.1f}s")
    compile_s = sum(engine.warmup(progress=True).values())
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=list(stop or []))
    try:
        ids = [engine.add_request(p, params) for p in prompts]
    except ValueError as e:
        raise SystemExit(f"thunder-batch generate: {e}") from e
    labels = {rid: _label(i, p) for i, (rid, p) in enumerate(zip(ids, prompts))}
    start = time.perf_counter()
    texts = _stream(engine, labels, Console())
    elapsed = time.perf_counter() - start
    _report(err, engine, texts, compile_s, elapsed)


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
                        print(f"{labels[o.request_id]}\n{texts[o.request_id]}\n(finish: {o.finish_reason})\n",
                              flush=True)
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
    err.print(f"{len(texts)} prompts, {tokens} tokens in {elapsed:.2f}s ({tokens / max(elapsed, 1e-9):.1f} tokens/s), "
              f"{stats['steps']} steps; compile {compile_s:.1f}s ({stats['traced']} programs traced, {stats['disk_cache_hits']} from disk); "
              f"peak RSS {peak_rss_mb:.0f} MiB")
    print(file=sys.stderr, flush=True)
