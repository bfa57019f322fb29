"""litgpt's own generation loops as benchmark baselines, on the same weights and token ids as the engine.

- litgpt-sequential: `generate_fn`, one prompt at a time (respects online arrival times).
- litgpt-batched: `batched_generate_fn`, which only takes prompts of one length: requests are grouped
  by prompt length and each group runs in batches of at most B; rows run to the group's longest
  output and the extra tokens are discarded (that waste is part of the baseline's cost).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from thunder_batch.bench_workloads import BenchRequest, same_length_groups
from thunder_batch.metrics import PeakMemory, RequestTrace


@dataclass
class BenchContext:
    """Settings shared by every system of one benchmark run."""

    device: torch.device
    max_seq_length: int
    prefill_chunk: int = 64
    eos_id: int | None = None
    ignore_eos: bool = False
    tokenizer: object = None
    progress: bool = True
    cache_dir: str | None = None  # None: a fresh temporary compile cache (cold compile = real trace)
    warm_compile: bool = True
    profile: bool = False

    @property
    def stop_tokens(self) -> tuple[list[int], ...]:
        return () if self.ignore_eos or self.eos_id is None else ([self.eos_id],)


@dataclass
class SystemRun:
    """What one system did on the workload: per-request traces and everything measured around them."""

    system: str
    batch_size: int | None  # None: independent of B (one prompt at a time)
    traces: list[RequestTrace]
    wall_s: float
    memory: dict
    compile: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)  # StepRecord per engine step (engine systems only)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


def wait_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, leave=False)


def fresh_model(gpt: torch.nn.Module, max_seq_length: int) -> torch.nn.Module:
    """A private copy of the weights, so no system sees another's caches or edits."""
    model = copy.deepcopy(gpt).eval().requires_grad_(False)
    model.max_seq_length = max_seq_length
    return model


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
            for token in generate_fn(model, prompt, len(r.prompt_ids) + r.max_new_tokens, temperature=0.0,
                                     stop_tokens=ctx.stop_tokens, include_prompt=False, include_eos=False):
                trace.record(token.view(-1).tolist(), time.perf_counter())
            bar.update(1)
        wall = time.perf_counter() - t0
    return SystemRun("litgpt-sequential", None, [traces[r.index] for r in workload], wall, memory.as_dict())


@torch.inference_mode()
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
            model.set_kv_cache(batch_size=len(group), device=ctx.device)
            prompts = torch.tensor([r.prompt_ids for r in group], device=ctx.device)
            longest = len(group[0].prompt_ids) + max(r.max_new_tokens for r in group)
            for row_tokens in batched_generate_fn(model, prompts, longest, sample_args=dict(temperature=0.0),
                                                  stop_tokens=ctx.stop_tokens, include_prompt=False,
                                                  include_eos=False):
                now = time.perf_counter()
                for r, token in zip(group, row_tokens):
                    trace = traces[r.index]
                    if token is not None and len(trace.token_ids) < r.max_new_tokens:
                        trace.record(token.view(-1).tolist(), now)
            bar.update(len(group))
        wall = time.perf_counter() - t0
    sizes = [len(g) for g in groups]
    note = (f"batched_generate_fn takes same-length prompts only: {len(groups)} groups "
            f"(mean size {sum(sizes) / len(sizes):.2f}, max {max(sizes)}) of {len(workload)} requests")
    return SystemRun("litgpt-batched", batch_size, [traces[r.index] for r in workload], wall, memory.as_dict(),
                     notes=[note], extra=dict(groups=len(groups), mean_group_size=sum(sizes) / len(sizes)))
