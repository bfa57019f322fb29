"""Greedy parity: litgpt's own single-prompt generate_fn as the oracle for batching, and the token diff.

Used by the benchmark's token checks, the tests and benchmarks/gpu_check.py.
"""

from __future__ import annotations

import copy
import math

import torch


def random_weights(gpt) -> None:
    """Weights N(0, 1/fan_in): logits O(1) apart, so greedy choices are not float-noise ties."""
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def litgpt_greedy(gpt, prompt: list[int], max_new_tokens: int, stop_tokens=()) -> list[int]:
    """Greedy token ids from litgpt's single-prompt generate_fn on a copy of `gpt` (prompt excluded).

    For attention softcapping (Gemma-2) litgpt 0.5.13's KV-cache path is wrong: it adds the boolean
    cache mask to the scores (+1/+0) instead of masking, so there the oracle is litgpt's uncached
    full forward, re-run on the whole sequence for every token.
    """
    from litgpt.generate.base import generate_fn

    if gpt.config.attention_logit_softcapping is not None:
        assert not stop_tokens
        return litgpt_greedy_uncached(gpt, prompt, max_new_tokens)
    model = copy.deepcopy(gpt)
    device = next(model.parameters()).device
    model.set_kv_cache(batch_size=1, max_seq_length=len(prompt) + max_new_tokens, device=device)
    out = generate_fn(
        model,
        torch.tensor(prompt, device=device),
        len(prompt) + max_new_tokens,
        temperature=0.0,
        stop_tokens=stop_tokens,
        include_prompt=False,
        include_eos=False,
    )
    return [int(t) for t in out]


@torch.no_grad()
def litgpt_greedy_uncached(gpt, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = next(gpt.parameters()).device
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(gpt(torch.tensor([tokens], device=device))[0, -1].argmax()))
    return tokens[len(prompt) :]


def compare_tokens(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """Greedy-token check of one system against the reference: mismatched requests, first divergence."""
    bad = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b]
    out = dict(mismatched_requests=len(bad), checked_requests=len(reference), first_mismatch=None)
    if bad:
        a, b = reference[bad[0]], tokens[bad[0]]
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["first_mismatch"] = dict(
            request=bad[0],
            position=pos,
            expected=a[pos : pos + 5],
            got=b[pos : pos + 5],
            expected_len=len(a),
            got_len=len(b),
        )
    return out
