"""The step program: model + sampler as three pieces, the same modules in eager and traced mode.

A step is `prefix` (embedding, per-slot RoPE gathers, masks), then one `BlockStep` per layer, then
`head` (final norm, lm_head on each slot's last real token, sampler). Thunder traces each piece once
per step width, and layers whose blocks Thunder checks the same way share one block trace, so a
cold compile costs a few pieces, not the model's depth. Eagerly, the same pieces run in sequence:
the eager run is the oracle for the compiled one.
"""

from __future__ import annotations

from litgpt.model import do_softcapping
from torch import nn

from thunder_batch.model import block_forward, step_inputs
from thunder_batch.sampler import batched_sample, greedy_sample


class StepPrefix(nn.Module):
    """Token embedding, RoPE tables gathered at each slot's positions, masks over the cache."""

    def __init__(self, gpt: nn.Module, cache_len: int) -> None:
        super().__init__()
        self.gpt = gpt
        self.cache_len = cache_len  # S + C: real entries and the padding scratch area

    def forward(self, idx, input_pos):
        # idx, input_pos: [B, T] -> x [B, T, C], cos/sin [B, T, n_elem], two masks [B, 1, T, S + C]
        return step_inputs(self.gpt, idx, input_pos, self.cache_len)


class BlockStep(nn.Module):
    """One transformer block with its slot KV cache. x: [B, T, C] -> [B, T, C]."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin, mask_global, mask_window, input_pos):
        # Argument names stay clear of the names Thunder's prologue gives submodules (m1, m2, ...).
        return block_forward(self.block, x, cos, sin, (mask_global, mask_window), input_pos)


HEADS = ("filtered", "unfiltered", "greedy")


class StepHead(nn.Module):
    """Final norm and lm_head on each slot's last real token, then the sampler.

    Three variants, each for the steps that need no more: "filtered" (top-k/top-p by a
    full-vocabulary sort), "unfiltered" (temperature sampling without the sort), "greedy" (argmax,
    no random noise). A row gets the same token and logprob from every variant that serves it.
    """

    def __init__(self, gpt: nn.Module, variant: str = "filtered") -> None:
        super().__init__()
        if variant not in HEADS:
            raise ValueError(f"head variant must be one of {HEADS}, got {variant!r}")
        self.gpt = gpt
        self.variant = variant

    def forward(self, x, input_pos, last_idx, temperature, top_k, top_p, seed):
        # x: [B, T, C]; input_pos: [B, T]; last_idx: [B] -> (token [B], logprob [B])
        gpt = self.gpt
        B, T, C = x.shape
        last_hidden = x.gather(1, last_idx.view(B, 1, 1).expand(B, 1, C)).squeeze(1)  # [B, C]
        logits = gpt.lm_head(gpt.transformer.ln_f(last_hidden))  # [B, V]: one position per slot, not T
        if gpt.config.final_logit_softcapping is not None:
            logits = do_softcapping(logits, gpt.config.final_logit_softcapping)
        last_pos = input_pos.gather(1, last_idx.view(B, 1)).squeeze(1)  # [B]
        # The RNG is keyed by the sampled token's own position: independent of slot and batch-mates.
        if self.variant == "greedy":
            return greedy_sample(logits)
        return batched_sample(
            logits, temperature, top_k, top_p, seed, last_pos + 1, filtered=self.variant == "filtered"
        )


class StepProgram(nn.Module):
    """All pieces of one step for a GPT with slot caches attached; calling it runs them in order."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        cache_len = gpt.transformer.h[0].attn.kv_cache.k.shape[2]
        self.prefix = StepPrefix(gpt, cache_len)
        self.blocks = nn.ModuleList(BlockStep(block) for block in gpt.transformer.h)
        self.heads = nn.ModuleDict({variant: StepHead(gpt, variant) for variant in HEADS})

    def forward(self, idx, input_pos, last_idx, temperature, top_k, top_p, seed, head: str = "filtered"):
        return run_step(
            self.prefix, list(self.blocks), self.heads[head], idx, input_pos, last_idx, temperature, top_k, top_p, seed
        )


def run_step(prefix, blocks, head, idx, input_pos, last_idx, temperature, top_k, top_p, seed):
    """Next token for every slot after feeding `idx` at per-slot positions `input_pos`.

    idx, input_pos: [B, T]; last_idx: [B], index in T of each slot's last real token;
    temperature, top_p: [B] float32; top_k, seed: [B] int64. Returns (token [B], logprob [B]).
    `prefix`, each of `blocks` and `head` are the pieces (modules, or their compiled programs).
    """
    x, cos, sin, mask_global, mask_window = prefix(idx, input_pos)
    for block in blocks:
        x = block(x, cos, sin, mask_global, mask_window, input_pos)
    return head(x, input_pos, last_idx, temperature, top_k, top_p, seed)


def batched_next_token(gpt, idx, input_pos, last_idx, temperature, top_k, top_p, seed):
    """One eager step of a GPT with slot caches attached (see `run_step`)."""
    return StepProgram(gpt)(idx, input_pos, last_idx, temperature, top_k, top_p, seed)
