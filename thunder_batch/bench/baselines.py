"""litgpt's own generation loops as benchmark baselines, on the same weights and token ids as the engine.

- litgpt-sequential: `generate_fn`, one prompt at a time (respects online arrival times).
- litgpt-batched: `batched_generate_fn`, which only takes prompts of one length: requests are grouped
  by prompt length and each group runs in batches of at most B; rows run to the group's longest
  output and the extra tokens are discarded (that waste is part of the baseline's cost).
"""

from __future__ import annotations

import time

import torch

from thunder_batch.bench.metrics import PeakMemory, RequestTrace
from thunder_batch.bench.system_run import BenchContext, SystemRun, fresh_model, progress_bar, wait_until
from thunder_batch.bench.workloads import BenchRequest, same_length_groups


@torch.inference_mode()
def run_litgpt_sequential(gpt, workload: list[BenchRequest], ctx: BenchContext) -> SystemRun:
    """litgpt `generate_fn` on one prompt at a time, in arrival order."""
    from litgpt.generate.base import generate_fn

    model = fresh_model(gpt, ctx.max_seq_length)
    model.set_kv_cache(batch_size=1, device=ctx.device)
    traces = {}
    with PeakMemory(ctx.device) as memory, progress_bar(len(workload), "litgpt-sequential", ctx.progress) as bar:
        t0 = time.perf_counter()
        for r in sorted(workload, key=lambda r: r.arrival_s):
            wait_until(t0 + r.arrival_s)
            trace = traces[r.index] = RequestTrace(len(r.prompt_ids), t0 + r.arrival_s)
            prompt = torch.tensor(r.prompt_ids, device=ctx.device)
            for token in generate_fn(
                model,
                prompt,
                len(r.prompt_ids) + r.max_new_tokens,
                temperature=0.0,
                stop_tokens=ctx.stop_tokens,
                include_prompt=False,
                include_eos=False,
            ):
                trace.record(token.view(-1).tolist(), time.perf_counter())
            bar.update(1)
        wall = time.perf_counter() - t0
    return SystemRun("litgpt-sequential", None, [traces[r.index] for r in workload], wall, memory.as_dict())


@torch.inference_mode()
def _generate_group(batched_generate_fn, model, group: list[BenchRequest], traces: dict, ctx: BenchContext) -> None:
    """One same-length group through litgpt's batched_generate_fn, greedy; each token recorded as it comes."""
    model.set_kv_cache(batch_size=len(group), device=ctx.device)
    prompts = torch.tensor([r.prompt_ids for r in group], device=ctx.device)
    longest = len(group[0].prompt_ids) + max(r.max_new_tokens for r in group)
    stream = batched_generate_fn(
        model,
        prompts,
        longest,
        sample_args=dict(temperature=0.0),
        stop_tokens=ctx.stop_tokens,
        include_prompt=False,
        include_eos=False,
    )
    for row_tokens in stream:
        now = time.perf_counter()
        for r, token in zip(group, row_tokens):
            trace = traces[r.index]
            if token is not None and len(trace.token_ids) < r.max_new_tokens:
                trace.record(token.view(-1).tolist(), now)


def run_litgpt_batched(gpt, workload: list[BenchRequest], batch_size: int, ctx: BenchContext) -> SystemRun:
    """litgpt `batched_generate_fn` over same-length groups of at most `batch_size` (offline only)."""
    from litgpt.generate.base import batched_generate_fn

    model = fresh_model(gpt, ctx.max_seq_length)
    groups = same_length_groups(workload, batch_size)
    traces: dict[int, RequestTrace] = {}
    bar = progress_bar(len(workload), f"litgpt-batched B={batch_size}", ctx.progress)
    with PeakMemory(ctx.device) as memory, bar:
        t0 = time.perf_counter()
        for group in groups:
            for r in group:
                traces[r.index] = RequestTrace(len(r.prompt_ids), t0)
            _generate_group(batched_generate_fn, model, group, traces, ctx)
            bar.update(len(group))
        wall = time.perf_counter() - t0
    sizes = [len(g) for g in groups]
    note = (
        f"batched_generate_fn takes same-length prompts only: {len(groups)} groups "
        f"(mean size {sum(sizes) / len(sizes):.2f}, max {max(sizes)}) of {len(workload)} requests"
    )
    return SystemRun(
        "litgpt-batched",
        batch_size,
        [traces[r.index] for r in workload],
        wall,
        memory.as_dict(),
        notes=[note],
        extra=dict(groups=len(groups), mean_group_size=sum(sizes) / len(sizes)),
    )
