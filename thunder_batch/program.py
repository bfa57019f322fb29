"""The step program: model + sampler as three pieces, the same modules in eager and traced mode.

A step is `prefix` (embedding, RoPE gathers, masks), then one `BlockStep` per layer, then `head`
(final norm, lm_head on each slot's last real row, sampler). A step's rows are B decode rows (row b
is slot b) then P prefill lanes of C rows (see model.py). Thunder traces each piece once per step
shape (rows N, entries read L), and layers whose blocks Thunder checks the same way share one block
trace, so a cold compile costs a few pieces, not the model's depth. Eagerly, the same pieces run in
sequence: the eager run is the oracle for the compiled one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from litgpt.model import do_softcapping
from torch import nn

from thunder_batch.config import MAX_LOGPROBS
from thunder_batch.kv_cache import SlotKVCache, slot_caches
from thunder_batch.model import StepShared, block_forward, layer_rope, rope_table, step_inputs
from thunder_batch.moe import fixed_shape_mlp
from thunder_batch.sampler import (
    batched_sample,
    controlled_logits,
    greedy_sample,
    logprob_of,
    score_rows,
    top_logprobs,
)


def rope_tables(gpt: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """litgpt's RoPE cos/sin for positions 0 .. length-1 ([length, n_elem] float32; [length, n_elem, 2],
    global and local, with rope_indices), computed afresh:
    a position's row does not depend on the table's length, and the model's own tables stay as they are."""
    cos, sin = gpt.rope_cache(device=gpt.transformer.wte.weight.device)
    return cos[:length].clone(), sin[:length].clone()


class StepPrefix(nn.Module):
    """Token embedding and what every block reads (`model.StepShared`): RoPE rows, the KV write's rows,
    masks over the entries read. cache_shape: each layer's cache [B, G, S', D]; lane_len: rows per lane."""

    def __init__(self, gpt: nn.Module, max_seq_length: int, cache_shape: tuple[int, ...], lane_len: int) -> None:
        super().__init__()
        self.gpt, self.cache_shape, self.lane_len = gpt, tuple(cache_shape), lane_len
        cos, sin = rope_tables(gpt, max_seq_length)
        self.register_buffer("cos", cos, persistent=False)  # [S, n_elem]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, input_pos, row_slot, key_pos):
        # idx, input_pos, row_slot: [N]; key_pos: [L] -> x [N, C], then the StepShared tensors in order
        rope = (self.cos, self.sin)
        x, shared = step_inputs(self.gpt, rope, self.cache_shape, idx, input_pos, row_slot, key_pos, self.lane_len)
        return (x, *shared)


class BlockStep(nn.Module):
    """One transformer block with its own slot KV cache. x: [N, C] -> [N, C]; lanes of `lane_len` rows
    (verify: verify lanes, speculative decoding).

    `rope_table` (Gemma-3: which RoPE table the layer reads) and `experts` (an MoE layer's stacked
    experts) are the block's own attributes, so Thunder checks them: layers differing in them never
    share a trace (litgpt's block_idx, which they follow from, is learned not to matter)."""

    def __init__(self, block: nn.Module, cache: SlotKVCache, lane_len: int, verify_of: BlockStep | None = None) -> None:
        super().__init__()
        self.block, self.cache, self.lane_len, self.verify = block, cache, lane_len, verify_of is not None
        self.rope_table = rope_table(block.config, block.attn.block_idx)
        # A verify program's layer shares its step program's stacked experts: one stack the model's experts view.
        self.experts = fixed_shape_mlp(block) if verify_of is None else verify_of.experts
        self.one_call = False  # decode-only steps as one op (set by the compile layer: compile.block_op)

    def forward(self, x, cos, sin, kv_rows, decode_mask, lane_slot, lane_mask):
        # Argument names stay clear of the names Thunder's prologue gives submodules (m1, m2, ...).
        cos, sin = layer_rope(cos, sin, self.rope_table)  # [N, 1, n_elem]: this layer's table
        shared = StepShared(cos, sin, kv_rows, decode_mask, lane_slot, lane_mask)
        return block_forward(self.block, self.cache, x, shared, self.lane_len, self.experts, self.verify, self.one_call)


class StepInputs(NamedTuple):
    """The tensors of one step, in the order every step program takes them: named here once, read by name."""

    idx: torch.Tensor  # [N] token ids (0 where padding); N = B decode rows + lanes * C
    input_pos: torch.Tensor  # [N] positions; padding carries its scratch entry (>= S)
    row_slot: torch.Tensor  # [N] the slot whose cache each row writes and reads
    key_pos: torch.Tensor  # [L] 0 .. L-1: the cache entries this step reads
    last_row: torch.Tensor  # [B] each slot's last real row (its decode row when it samples nothing)
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32
    seed: torch.Tensor  # [B] int64
    target: torch.Tensor | None = None  # [N] int64: the next prompt token of each row a `_prompt` head scores
    # (0 where none), or each row's slot for a verify head
    # A `controlled_` head's logit controls (control_rows.ControlRows; None for the other heads):
    bias: torch.Tensor | None = None  # [B, V] float32: logit_bias, -inf on stop tokens held back by min_tokens
    counts: torch.Tensor | None = None  # [B, V] float32: times each token was generated
    seen: torch.Tensor | None = None  # [B, V] bool: in the prompt or the output
    allowed: torch.Tensor | None = None  # [B, ceil(V / 32)] int32: the tokens each row's grammar allows, as bits
    knobs: torch.Tensor | None = None  # [B, 4] float32: presence, frequency, repetition penalties, min_p

    def prefix_args(self) -> tuple[torch.Tensor, ...]:
        """StepPrefix's arguments."""
        return self.idx, self.input_pos, self.row_slot, self.key_pos

    def head_args(self, x: torch.Tensor) -> tuple:
        """A head's arguments after the layers' output x [N, C] (StepHead.forward, VerifyHead.forward)."""
        args = (x, self.input_pos, self.last_row, self.temperature, self.top_k, self.top_p, self.seed, self.target)
        return args if self.knobs is None else (*args, self.bias, self.counts, self.seen, self.allowed, self.knobs)

    def program_args(self) -> tuple:
        """The tensors a step program takes: the controls only when there are some."""
        return tuple(self) if self.knobs is not None else tuple(self)[: self._fields.index("bias")]


HEADS = ("filtered", "unsorted", "greedy")  # the samplers; each head variant is one of them
EXTRAS = ("top", "prompt")  # what a variant adds: "greedy_top", "filtered_prompt", ...


def variant_name(sampler: str, extra: str = "", verify: bool = False, controlled: bool = False) -> str:
    """A head variant's name (a compiled program's key): "greedy", "filtered_top", "controlled_greedy",
    "verify_unsorted_top", ... (`controlled_`: it applies the rows' logit controls first)."""
    name = f"{sampler}_{extra}" if extra else sampler
    name = f"controlled_{name}" if controlled else name
    return f"verify_{name}" if verify else name


# name -> (sampler, extra, controlled): the one place a variant's name is taken apart
VARIANT_PARTS = {
    variant_name(h, e, controlled=c): (h, e, c) for c in (False, True) for h in HEADS for e in ("", *EXTRAS)
}
VARIANTS = tuple(VARIANT_PARTS)


class StepHead(nn.Module):
    """Final norm and lm_head on each slot's last real row, then the sampler.

    Three samplers, each for the steps that need no more: "filtered" (any top-k/top-p; rows that
    need it by a full-vocabulary sort), "unsorted" (temperature, and top-k up to SMALL_TOP_K from the
    top-k values: no sort), "greedy" (argmax, no random noise). A row gets the same token and logprob
    from every variant that serves it.
    Variants `<sampler>_top` also return each slot's MAX_LOGPROBS most likely tokens and their
    logprobs; `<sampler>_prompt` also score every row of the step (the prompt rows) against its
    `target` token, with alternatives: lm_head then runs on all N rows, not only the last ones.
    Variants `controlled_*` apply the rows' logit controls (`sampler.controlled_logits`, min_p) before the
    sampler; their logprobs stay the model's own, under the grammar's mask for a constrained row.
    """

    def __init__(self, gpt: nn.Module, variant: str = "filtered") -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"head variant must be one of {VARIANTS}, got {variant!r}")
        self.gpt = gpt
        self.variant, self.extra, self.controlled = VARIANT_PARTS[variant]

    def logits(self, hidden):
        # hidden: [R, C] -> [R, V]
        gpt = self.gpt
        logits = gpt.lm_head(gpt.transformer.ln_f(hidden))
        if gpt.config.final_logit_softcapping is not None:
            logits = do_softcapping(logits, gpt.config.final_logit_softcapping)
        return logits

    def forward(self, x, input_pos, last_row, temperature, top_k, top_p, seed, target=None, *controls):
        # x: [N, C]; input_pos, target: [N]; last_row: [B]; controls: StepInputs' bias, counts, seen, allowed, knobs
        # -> (token [B], logprob [B]) and, per variant, (top ids [B, K], top logprobs [B, K]), (row logprob
        # [N], ids [N, K], logprobs [N, K])
        logits = self.logits(x.index_select(0, last_row))  # [B, V]: one row per slot, not N
        out = self.sampled(logits, input_pos.index_select(0, last_row), temperature, top_k, top_p, seed, controls)
        if self.extra != "prompt":
            return out
        return (*out, *score_rows(self.logits(x), target, MAX_LOGPROBS))  # its own matmul: [B] rows unchanged

    def sampled(self, logits, last_pos, temperature, top_k, top_p, seed, controls=()):
        # logits: [B, V]; last_pos and the settings: [B]; controls: () or (bias, counts, seen, allowed, knobs) ->
        # (token [B], logprob [B]), then with "top" or "prompt" (top ids [B, K], top logprobs [B, K])
        # The RNG is keyed by the sampled token's own position: independent of slot and batch-mates.
        steered, min_p, reported = logits, None, logits
        if self.controlled:
            # [B, V] each: a grammar's distribution, and what the other controls make of it
            reported, steered = controlled_logits(logits.float(), *controls)
            min_p = controls[-1][:, 3]  # [B]
        if self.variant == "greedy":
            out = greedy_sample(steered)
        else:
            sort = self.variant == "filtered"
            out = batched_sample(steered, temperature, top_k, top_p, seed, last_pos + 1, sort=sort, min_p=min_p)
        if self.controlled:  # logprobs: the model's own, under the grammar's mask (penalties steer, not report)
            out = (out[0], logprob_of(reported, out[0]))
        return (*out, *top_logprobs(reported, MAX_LOGPROBS)) if self.extra else out


class VerifyHead(StepHead):
    """The head of a verify step (speculative decoding): one lm_head over the slots' last rows and every
    verify-lane row (rows B ..); the slots sampled as StepHead does, then each verify row's sample at its
    own position with its slot's settings, the same sampler and (seed, position) noise as a decode row
    there: a row samples exactly the token plain decoding would after the same prefix. `target` carries
    each row's slot. Variant `<sampler>_top` adds every row's most likely tokens."""

    def forward(self, x, input_pos, last_row, temperature, top_k, top_p, seed, target=None, *controls):
        # x: [N, C]; input_pos, target (row slots): [N]; the rest [B] -> StepHead's outputs, then
        # (row token [R], row logprob [R]) and with `_top` (row ids [R, K], row logprobs [R, K]); R = N - B
        B = last_row.shape[0]
        # One lm_head over the slots' last rows and every verify row: its weights are read once, not twice.
        logits = self.logits(torch.cat((x.index_select(0, last_row), x[B:])))  # [B + R, V]
        # The slots' rows take their controls; a controlled request never drafts, so no verify row needs them.
        out = self.sampled(logits[:B], input_pos.index_select(0, last_row), temperature, top_k, top_p, seed, controls)
        slots, logits = target[B:], logits[B:]  # [R], [R, V]
        position = input_pos[B:] + 1  # [R]: the position of the token each row samples
        if self.variant == "greedy":
            rows = greedy_sample(logits)
        else:
            settings = (t.index_select(0, slots) for t in (temperature, top_k, top_p, seed))  # [R] each
            rows = batched_sample(logits, *settings, position, sort=self.variant == "filtered")
        if self.extra == "top":
            rows = (*rows, *top_logprobs(logits, MAX_LOGPROBS))
        return (*out, *rows)


VERIFY_VARIANTS = {
    variant_name(h, e, True, c): variant_name(h, e, controlled=c)
    for c in (False, True)
    for e in ("", "top")
    for h in HEADS
}


class StepProgram(nn.Module):
    """All pieces of one step for a GPT, with B slots of `max_seq_length` cache each; calling it runs them
    in order. lane_len: rows per prefill lane (the prefill chunk C). The program owns the slot caches
    (one per layer, with scratch room for padding: see SlotKVCache) and its RoPE tables; the GPT's
    weights are shared, never copied (an MoE layer's expert weights move into its stack: the same
    Parameters and values, see moe.py), and the GPT itself is left as it was.

    `verify_of`: make instead the verify program of that StepProgram (speculative decoding): its lanes
    are verify lanes of `lane_len` rows, its heads `VERIFY_VARIANTS`, and it reads and writes the
    same slot caches (their scratch room, C past S, holds a verify lane's pads: lane_len <= C)."""

    def __init__(self, gpt: nn.Module, batch_size: int, max_seq_length: int, lane_len: int = 1, verify_of=None) -> None:
        super().__init__()
        if verify_of is None:
            self.caches = nn.ModuleList(slot_caches(gpt, batch_size, max_seq_length + 1 + lane_len))
            self.heads = nn.ModuleDict({variant: StepHead(gpt, variant) for variant in VARIANTS})
        else:
            self.caches = verify_of.caches
            self.heads = nn.ModuleDict({v: VerifyHead(gpt, plain) for v, plain in VERIFY_VARIANTS.items()})
            # Its shape puts the verify lane's length in the compile cache key (module_signature).
            self.register_buffer(
                "verify_rows", torch.zeros(lane_len, device=gpt.transformer.wte.weight.device), persistent=False
            )
        cache_shape = self.caches[0].k.shape
        self.prefix = StepPrefix(gpt, max_seq_length, cache_shape, lane_len)
        steps = verify_of.blocks if verify_of is not None else [None] * len(self.caches)
        self.blocks = nn.ModuleList(
            BlockStep(block, cache, lane_len, verify_of=step)
            for block, cache, step in zip(gpt.transformer.h, self.caches, steps)
        )

    def forward(self, *inputs: torch.Tensor, head: str | tuple[str, ...] = "filtered"):
        """inputs: the StepInputs' tensors in their order. head: a variant, or a tuple of them: the layers run
        once and each head on their output (a tuple of their outputs), so a warm-up makes every head without
        running the layers again."""
        heads = [self.heads[h] for h in head] if isinstance(head, tuple) else self.heads[head]
        return run_step(self.prefix, list(self.blocks), heads, StepInputs(*inputs))


def run_step(prefix, blocks, head, inputs: StepInputs):
    """Next token for every slot after feeding the step's rows: (token [B], logprob [B]) and the head
    variant's extras (see StepHead). `prefix`, each of `blocks` and `head` are the pieces (modules, or their
    compiled programs); `head` may be a list of heads: a tuple of their outputs."""
    x, *shared = prefix(*inputs.prefix_args())
    for block in blocks:
        x = block(x, *shared)
    head_args = inputs.head_args(x)
    return tuple(h(*head_args) for h in head) if isinstance(head, list) else head(*head_args)
