"""The step program: model + sampler, one function, the same in eager and traced mode."""

from __future__ import annotations

import torch
from torch import nn

from litgpt.model import do_softcapping

from thunder_batch.model import forward_hidden
from thunder_batch.sampler import batched_sample


def batched_next_token(gpt, idx, input_pos, last_idx, temperature, top_k, top_p, seed):
    """Next token for every slot after feeding `idx` at per-slot positions `input_pos`.

    idx, input_pos: [B, T]; last_idx: [B], index in T of each slot's last real token;
    temperature, top_p: [B] float32; top_k, seed: [B] int64. Returns (token [B], logprob [B]).
    Everything is a tensor, so one trace serves any occupancy and any sampling settings.
    """
    hidden = forward_hidden(gpt, idx, input_pos)  # [B, T, C]
    B, T, C = hidden.shape
    gather_idx = last_idx.view(B, 1, 1).expand(B, 1, C)  # [B, 1, C]
    last_hidden = hidden.gather(1, gather_idx).squeeze(1)  # [B, C]
    logits = gpt.lm_head(last_hidden)  # [B, V]: lm_head on one position per slot, not T
    if gpt.config.final_logit_softcapping is not None:
        logits = do_softcapping(logits, gpt.config.final_logit_softcapping)
    last_pos = input_pos.gather(1, last_idx.view(B, 1)).squeeze(1)  # [B]
    # The RNG is keyed by the sampled token's own position: independent of slot and batch-mates.
    return batched_sample(logits, temperature, top_k, top_p, seed, last_pos + 1)


class StepProgram(nn.Module):
    """Wraps a GPT (with slot caches attached) so `batched_next_token` can be jitted as a module."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, input_pos, last_idx, temperature, top_k, top_p, seed):
        return batched_next_token(self.gpt, idx, input_pos, last_idx, temperature, top_k, top_p, seed)
