"""Owns the model, its slot caches and the step program; turns a StepPlan into tensors and runs it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from thunder_batch.compile import load_or_compile_program
from thunder_batch.config import EngineConfig
from thunder_batch.kv_cache import attach_slot_caches
from thunder_batch.model import check_supported
from thunder_batch.program import HEADS, StepProgram
from thunder_batch.scheduler import StepPlan


@dataclass
class StepInputs:
    idx: torch.Tensor  # [B, T] token ids (0 where padding)
    input_pos: torch.Tensor  # [B, T] positions; padding t carries S + t (its scratch entry)
    last_idx: torch.Tensor  # [B] index in T of each slot's last real token
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64

    def as_args(self) -> tuple[torch.Tensor, ...]:
        return (self.idx, self.input_pos, self.last_idx, self.temperature, self.top_k, self.top_p, self.seed)


class Runner:
    """The model side of the engine: B slots of `max_seq_length` cache each, one step program."""

    def __init__(self, gpt: torch.nn.Module, config: EngineConfig) -> None:
        check_supported(gpt.config)
        if config.max_seq_length > gpt.config.block_size:
            raise ValueError(
                f"max_seq_length ({config.max_seq_length}) exceeds the model's context "
                f"length (block_size {gpt.config.block_size})"
            )
        self.config = config
        self.device = gpt.lm_head.weight.device
        gpt.max_seq_length = config.max_seq_length
        gpt.eval().requires_grad_(False)
        # Room for the widest step's padding past the real positions (see SlotKVCache).
        attach_slot_caches(gpt, config.batch_size, config.max_seq_length + max(config.step_widths))
        self.gpt = gpt
        self.program = StepProgram(gpt)
        self.step_fn = load_or_compile_program(self.program, config)
        # A head without the top-k/top-p sort is one more small piece, but one more whole trace of
        # the model with trace="step": there, every step keeps the sort.
        whole_step = config.compile == "thunder" and config.trace == "step"
        self.head_variants = ("filtered",) if whole_step else HEADS

    def inputs_for(self, plan: StepPlan) -> StepInputs:
        B, T, S = self.config.batch_size, plan.width, self.config.max_seq_length
        idx = [[0] * T for _ in range(B)]
        pos = [[S + t for t in range(T)] for _ in range(B)]
        last, temperature, top_k, top_p, seed = [0] * B, [0.0] * B, [0] * B, [1.0] * B, [0] * B
        for w in plan.work:
            n, params = len(w.token_ids), w.request.params
            idx[w.slot][:n] = w.token_ids
            pos[w.slot][:n] = range(w.start_pos, w.start_pos + n)
            last[w.slot] = n - 1
            temperature[w.slot], top_p[w.slot] = float(params.temperature), float(params.top_p)
            top_k[w.slot], seed[w.slot] = params.top_k or 0, w.request.seed
        long, dev = torch.int64, self.device
        return StepInputs(
            torch.tensor(idx, dtype=long, device=dev),
            torch.tensor(pos, dtype=long, device=dev),
            torch.tensor(last, dtype=long, device=dev),
            torch.tensor(temperature, dtype=torch.float32, device=dev),
            torch.tensor(top_k, dtype=long, device=dev),
            torch.tensor(top_p, dtype=torch.float32, device=dev),
            torch.tensor(seed, dtype=long, device=dev),
        )

    def warmup(self, progress: bool = False) -> dict[int, float]:
        """Run every step width once with all slots empty (padding writes only scratch entries), so
        tracing happens now rather than at the first request; returns seconds per width."""
        import time

        from tqdm import tqdm

        seconds = {}
        widths = tqdm(
            self.config.step_widths,
            desc=f"compiling ({self.config.compile})",
            unit="shape",
            disable=not progress,
            file=sys.stderr,
        )
        for width in widths:
            start = time.perf_counter()
            for head in self.head_variants:  # with and without the top-k/top-p sort, greedy
                self.run(StepPlan(width, []), head)
            seconds[width] = time.perf_counter() - start
        return seconds

    def run(self, plan: StepPlan, head: str | None = None) -> tuple[list[int], list[float]]:
        """One step; returns the sampled token and its logprob for every slot (one host sync).
        The head (see StepHead) is the cheapest that serves every slot sampling this step."""
        if head is None:
            head = head_for(plan) if len(self.head_variants) > 1 else self.head_variants[0]
        with torch.no_grad():
            token, logprob = self.step_fn(*self.inputs_for(plan).as_args(), head=head)
        return token.tolist(), logprob.tolist()


def head_for(plan: StepPlan) -> str:
    """ "greedy" when no slot that samples this step has temperature > 0, "filtered" when one of
    those uses top-k or top-p, else "unfiltered". Slots still prefilling sample nothing that counts."""
    sampling = [w.request.params for w in plan.work if w.samples and w.request.params.temperature > 0]
    if not sampling:
        return "greedy"
    return "filtered" if any(p.top_k or p.top_p < 1 for p in sampling) else "unfiltered"
