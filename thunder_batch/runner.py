"""Owns the step program (with its slot caches) over a model's weights; turns a StepPlan into tensors and runs it."""

from __future__ import annotations

import functools
import sys
import time
from dataclasses import dataclass

import torch

from thunder_batch.compile.step import follow_weights, load_or_compile_program, outputs_unused
from thunder_batch.compile.step import program_stats as step_program_stats
from thunder_batch.config import EngineConfig, StepShape
from thunder_batch.control_rows import ControlRows
from thunder_batch.kv_cache import copy_entries
from thunder_batch.logit_controls import has_controls
from thunder_batch.model import check_supported
from thunder_batch.moe import restack
from thunder_batch.program import HEADS, StepInputs, StepProgram, variant_name
from thunder_batch.sampler import needs_sort
from thunder_batch.step_plan import SlotWork, StepPlan
from thunder_batch.weights import WeightWatch, copy_weights


@dataclass
class StepResult:
    """What one step returned, as Python lists: per slot the sampled token and its logprob; with a
    `_top` or `_prompt` head each slot's most likely tokens [(id, logprob)] * MAX_LOGPROBS; with a
    `_prompt` head, per row (N) its target's logprob and the row's most likely tokens."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None = None
    row_logprobs: list[float] | None = None
    row_top: list[list[tuple[int, float]]] | None = None
    # A verify step's: per verify-lane row (lane * (k + 1) + j) its sampled token, logprob, alternatives
    verify_tokens: list[int] | None = None
    verify_logprobs: list[float] | None = None
    verify_top: list[list[tuple[int, float]]] | None = None
    inputs_seconds: float = 0.0  # building the step's input tensors
    shape: StepShape | None = None  # the step's shape


class Runner:
    """The model side of the engine: B slots of `max_seq_length` cache each, one step program.
    It reads the GPT's weights (shared, not copied) and never changes the GPT: the slot caches and
    RoPE tables are the step program's own."""

    def __init__(self, gpt: torch.nn.Module, config: EngineConfig) -> None:
        check_supported(gpt.config)
        if config.max_seq_length > gpt.config.block_size:
            raise ValueError(
                f"max_seq_length ({config.max_seq_length}) exceeds the model's context "
                f"length (block_size {gpt.config.block_size})"
            )
        self.config = config
        self.device = gpt.transformer.wte.weight.device
        self.gpt = gpt
        self.program = StepProgram(gpt, config.batch_size, config.max_seq_length, config.prefill_chunk)
        self.caches = list(self.program.caches)  # one SlotKVCache per layer
        self.saved_prefixes: dict[int, list] = {}  # stored prefix -> its entries per layer (prefix_store)
        self.step_fn = load_or_compile_program(self.program, config, self.probe_inputs)
        self.verify_fn = None  # speculative decoding: the verify program, over the same caches
        if config.speculative_tokens:
            lane_len = config.speculative_tokens + 1
            verify = StepProgram(gpt, config.batch_size, config.max_seq_length, lane_len, verify_of=self.program)
            self.verify_fn = load_or_compile_program(verify, config, functools.partial(self.probe_inputs, verify=True))
        self.watch = WeightWatch(gpt)  # after the MoE stacks: their experts' weights are views of them
        # A head without the top-k/top-p sort is one more small piece, but one more whole trace of
        # the model with trace="step": there, every step keeps the sort.
        whole_step = config.compile == "thunder" and config.trace == "step"
        self.head_variants = ("filtered",) if whole_step else HEADS
        self.controls = ControlRows(config.batch_size, gpt.config.padded_vocab_size, self.device)

    def follow_weights(self) -> bool:
        """Before each step: whether any weight changed since the last call (the first: since the runner was
        built), in place or by a new tensor or new data (`weights.WeightWatch`). The programs follow weights that
        moved to other memory from this step on, with no retrace; a changed shape, dtype or device, or a
        replaced submodule, raises WeightsChangedError and changes nothing."""
        changes = self.watch.changes()
        if changes.moved:
            self._follow(changes.moved)
        return changes.edited

    def refresh_weights(self) -> None:
        """Every weight read afresh: for writes no version counter sees (`p.data.copy_(t)`)."""
        self._follow(self.watch.every_parameter())

    def update_weights(self, weights) -> None:
        """Copy new values into the model's weights in place (`weights.copy_weights`); packed copies made now."""
        self._follow(copy_weights(self.gpt, weights))

    def _follow(self, moved: list[torch.Tensor]) -> None:
        """The programs (and MoE stacks) read `moved` as they are now; their packed copies are made again."""
        for block in self.program.blocks:  # a verify program's layers share these stacks
            if block.experts is not None:
                restack(block.experts, block.block.mlp)
        for fn in (self.step_fn, self.verify_fn):
            if fn is not None:
                follow_weights(fn, moved)
        self.watch.changes()  # what this did (expert weights pointed at their stacks again) is no change

    def shape_for(self, plan: StepPlan) -> StepShape:
        """The fewest lanes holding the plan's; the shortest rung covering every fed position."""
        length = self.config.attention_length(plan.span)
        if plan.verify:
            return StepShape(self.config.verify_lanes_for(plan.busy_lanes), length, verify=True)
        return StepShape(self.config.lanes_for(plan.busy_lanes), length)

    def lane_len(self, verify: bool) -> int:
        """Rows per lane: prefill_chunk, or speculative_tokens + 1 for a verify lane."""
        return self.config.speculative_tokens + 1 if verify else self.config.prefill_chunk

    def inputs_for(self, plan: StepPlan, shape: StepShape | None = None) -> StepInputs:
        shape = shape or self.shape_for(plan)
        B, S, C = self.config.batch_size, self.config.max_seq_length, self.lane_len(shape.verify)
        # decode row b: slot b, pad at scratch entry S; lane p token t: its slot, pad at S + 1 + t
        idx = [0] * self.config.step_rows(shape.lanes, shape.verify)
        pos = [S] * B + [S + 1 + t for _ in range(shape.lanes) for t in range(C)]
        row_slot = list(range(B)) + _lane_slots(plan, shape.lanes, B, C)
        last, temperature, top_k, top_p, seed = list(range(B)), [0.0] * B, [0] * B, [1.0] * B, [0] * B
        target = [0] * len(idx)
        for w in plan.work:
            first = self.first_row(w)
            n, params = len(w.token_ids), w.request.params
            idx[first : first + n] = w.token_ids
            pos[first : first + n] = range(w.start_pos, w.start_pos + n)
            last[w.slot] = w.slot if w.draft else first + n - 1  # a verify lane samples every row
            temperature[w.slot], top_p[w.slot] = float(params.temperature), float(params.top_p)
            top_k[w.slot], seed[w.slot] = params.top_k or 0, w.request.seed
            if scores_prompt(w):  # row i is scored against the prompt token after it
                target[first : first + n] = (w.request.prompt_ids[w.start_pos + 1 : w.start_pos + n + 1] + [0])[:n]
        if shape.verify:  # the verify head reads each row's slot from `target`
            target = row_slot
        long, dev = torch.int64, self.device
        return StepInputs(
            idx=torch.tensor(idx, dtype=long, device=dev),
            input_pos=torch.tensor(pos, dtype=long, device=dev),
            row_slot=torch.tensor(row_slot, dtype=long, device=dev),
            key_pos=torch.arange(shape.length, dtype=long, device=dev),
            last_row=torch.tensor(last, dtype=long, device=dev),
            temperature=torch.tensor(temperature, dtype=torch.float32, device=dev),
            top_k=torch.tensor(top_k, dtype=long, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev),
            seed=torch.tensor(seed, dtype=long, device=dev),
            target=torch.tensor(target, dtype=long, device=dev),
            **(self.controls.inputs(plan.work) or {}),
        )

    def probe_inputs(self, rows: int, length: int, verify: bool = False) -> StepInputs:
        """Step arguments of `rows` rows and `length` entries read in which every row is real, for the
        compile cache's load-time check (a warm-up's rows are all padding, touching scratch entries only):
        lane p feeds slot p the chunk ending at entry length - 1, so it reads what it writes; every other
        slot decodes one token at a spread position; every sampler setting is on; tokens are random.
        `verify`: lanes are verify lanes, and `target` is each row's slot (the verify head's input)."""
        B, S, C = self.config.batch_size, self.config.max_seq_length, self.lane_len(verify)
        lanes, fed = (rows - B) // C, min(C, length)
        generator = torch.Generator().manual_seed(rows * 100_003 + length)
        idx = torch.randint(self.gpt.config.padded_vocab_size, (rows,), generator=generator)
        pos = [S if b < lanes else (13 * b) % length for b in range(B)]
        pos += [length - fed + t if t < fed else S + 1 + t for _ in range(lanes) for t in range(C)]
        row_slot = list(range(B)) + [p for p in range(lanes) for _ in range(C)]
        last = [B + b * C + fed - 1 if b < lanes else b for b in range(B)]
        target = torch.randint(self.gpt.config.padded_vocab_size, (rows,), generator=generator)
        if verify:
            target = torch.tensor(row_slot)
        long, dev = torch.int64, self.device
        return StepInputs(
            idx=idx.to(dev),
            input_pos=torch.tensor(pos, dtype=long, device=dev),
            row_slot=torch.tensor(row_slot, dtype=long, device=dev),
            key_pos=torch.arange(length, dtype=long, device=dev),
            last_row=torch.tensor(last, dtype=long, device=dev),
            temperature=torch.full((B,), 0.8, dtype=torch.float32, device=dev),
            top_k=torch.full((B,), 5, dtype=long, device=dev),
            top_p=torch.full((B,), 0.9, dtype=torch.float32, device=dev),
            seed=torch.arange(1, B + 1, dtype=long, device=dev),
            target=target.to(dev),
        )

    def first_row(self, work: SlotWork) -> int:
        """The step row of a work's first token: its slot's decode row, or the start of its lane."""
        if work.lane is None:
            return work.slot
        return self.config.batch_size + work.lane * self.lane_len(bool(work.draft))

    def copy_prefixes(self, copies, dropped=()) -> None:
        """Copy cache entries between slots, to host memory and back (kv_cache.copy_entries), then free
        the `dropped` stored prefixes. In place: the step program (traced, loaded, or a CUDA graph)
        reads and writes these same buffers."""
        copy_entries(self.caches, copies, self.saved_prefixes)
        for entry in dropped:  # a save that a failed step never reached left nothing to free
            self.saved_prefixes.pop(entry, None)

    def warmup(self, progress: bool = False) -> dict[str, float]:
        """Run every step shape once with all slots empty (padding writes only scratch entries), so
        tracing happens now rather than at the first request; returns seconds per shape (described)."""
        import time

        from tqdm import tqdm

        seconds = {}
        shapes = tqdm(
            self.config.step_shapes,
            desc=f"compiling ({self.config.compile})",
            unit="shape",
            disable=not progress,
            file=sys.stderr,
        )
        for shape in shapes:
            start = time.perf_counter()
            # Heads see N rows, not L: every variant once per row count (the ladder's first rung).
            first_rung = shape.length == self.config.ladder[0]
            heads = tuple(variant_name(h, verify=shape.verify) for h in self.head_variants)
            self.warm(shape, heads if first_rung else heads[:1])
            seconds[shape.describe(self.config)] = time.perf_counter() - start
        return seconds

    def warm(self, shape: StepShape, heads: tuple[str, ...]) -> None:
        """One empty step of `shape`: its programs made, each layer program run once (the layers after
        the first that a program serves are bound, not run: `outputs_unused`) and each of `heads` on
        the output, a loaded head only by its check (at B = 64 a prompt-wide step runs for seconds: not
        once per head)."""
        head = heads[0] if len(heads) == 1 else heads  # one head: the call the steps make
        fn = self.verify_fn if shape.verify else self.step_fn
        with torch.no_grad(), outputs_unused(fn):
            fn(*self.inputs_for(StepPlan([], verify=shape.verify), shape).program_args(), head=head)

    def run(self, plan: StepPlan, head: str | None = None, shape: StepShape | None = None) -> StepResult:
        """One step; returns the sampled token and its logprob for every slot (one host sync), and
        the alternatives its head variant adds. The head (see StepHead) is the cheapest that serves
        every slot sampling this step, and every slot asking for logprob alternatives."""
        if head is None:
            head = head_for(plan, None if len(self.head_variants) > 1 else self.head_variants[0])
        fn = self.verify_fn if plan.verify else self.step_fn
        with torch.no_grad():
            self.copy_prefixes(plan.copies, plan.dropped)
            start = time.perf_counter()
            shape = shape or self.shape_for(plan)
            inputs = self.inputs_for(plan, shape)
            inputs_seconds = time.perf_counter() - start
            out = fn(*inputs.program_args(), head=variant_name(head, verify=plan.verify))
        result = _verify_result(out) if plan.verify else _step_result(out)
        result.inputs_seconds, result.shape = inputs_seconds, shape
        return result


def _step_result(out: tuple) -> StepResult:
    """A head's outputs as lists (see StepResult)."""
    result = StepResult(out[0].tolist(), out[1].tolist())
    if len(out) > 2:
        result.top = _pairs(out[2], out[3])
    if len(out) > 4:
        result.row_logprobs, result.row_top = out[4].tolist(), _pairs(out[5], out[6])
    return result


def _verify_result(out: tuple) -> StepResult:
    """A verify head's outputs: (token, logprob) [B], with `_top` (ids, logprobs) [B, K]; then the same per
    verify row."""
    half = len(out) // 2
    result = StepResult(out[0].tolist(), out[1].tolist(), verify_tokens=out[half].tolist())
    result.verify_logprobs = out[half + 1].tolist()
    if half > 2:
        result.top, result.verify_top = _pairs(out[2], out[3]), _pairs(out[half + 2], out[half + 3])
    return result


def program_stats(runner: Runner) -> dict:
    """The step programs' counters (compile.step.program_stats), the verify program's added in."""
    stats = step_program_stats(runner.step_fn)
    if runner.verify_fn is None:
        return stats
    for name, value in step_program_stats(runner.verify_fn).items():
        if name == "fallbacks":  # this process's, not a program's: counted once already
            continue
        if isinstance(value, dict):
            stats[name] = dict(stats[name])
            for key, n in value.items():
                stats[name][key] = stats[name].get(key, 0) + n if isinstance(n, (int, float)) else n
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            stats[name] = stats[name] + value
    return stats


def _pairs(ids: torch.Tensor, logprobs: torch.Tensor) -> list[list[tuple[int, float]]]:
    """[R, K] ids and logprobs -> per row [(id, logprob)] * K, without the tokens a grammar ruled out (-inf)."""
    return [[(t, p) for t, p in zip(i, lp) if p != float("-inf")] for i, lp in zip(ids.tolist(), logprobs.tolist())]


def _lane_slots(plan: StepPlan, lanes: int, B: int, C: int) -> list[int]:
    """Slot of each lane row: a busy lane's own slot; an idle lane borrows a slot no busy lane uses,
    so that no two pads write the same scratch entry."""
    busy = {w.lane: w.slot for w in plan.work if w.lane is not None}
    spare = iter(s for s in range(B) if s not in busy.values())
    return [slot for lane in range(lanes) for slot in [busy[lane] if lane in busy else next(spare)] * C]


def head_for(plan: StepPlan, sampler: str | None = None) -> str:
    """ "greedy" when no slot that samples this step has temperature > 0, "filtered" when one of
    those needs the sampler's full-vocabulary sort (top-p, or top-k above SMALL_TOP_K), else
    "unsorted" (or `sampler`, when given); prefixed "controlled_" when one of them sets a logit control
    (logit_controls.py). Slots still prefilling
    sample nothing that counts. Suffixed "_prompt" when a row is scored against the next prompt
    token (prompt logprobs), else "_top" when a sampling slot wants logprob alternatives."""
    sampler = sampler or _sampler_for(plan)
    controlled = any(w.samples and has_controls(w.request.params) for w in plan.work)
    if any(scores_prompt(w) for w in plan.work):
        return variant_name(sampler, "prompt", controlled=controlled)
    if any(w.samples and w.request.params.logprobs for w in plan.work):
        return variant_name(sampler, "top", controlled=controlled)
    return variant_name(sampler, controlled=controlled)


def _sampler_for(plan: StepPlan) -> str:
    sampling = [w.request.params for w in plan.work if w.samples and w.request.params.temperature > 0]
    if not sampling:
        return "greedy"
    return "filtered" if any(needs_sort(p.top_k, p.top_p) for p in sampling) else "unsorted"


def scores_prompt(work: SlotWork) -> bool:
    """Whether this work feeds a prompt token whose successor's logprob its request asked for."""
    request = work.request
    return request.params.prompt_logprobs is not None and work.start_pos < len(request.prompt_ids) - 1
