"""Invariant 6 (docs/DESIGN.md): greedy output is token-identical to litgpt's generate_fn run one prompt at a time."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams

from helpers import ENGINE_CONFIG, litgpt_greedy, mixed_prompts, tiny_gpt

# 1 token up to more than 3 chunks; 12 prompts through 4 slots, so slots are reused.
LENGTHS = [1, 2, 5, 8, 9, 13, 16, 17, 25, 30, 3, 11]
MAX_NEW = 8


@functools.cache
def litgpt_tokens(family: str) -> tuple[list[int], ...]:
    """litgpt's greedy tokens for the prompts, once per family (every test of a family compares to them)."""
    gpt = tiny_gpt(family)
    return tuple(litgpt_greedy(gpt, p, MAX_NEW) for p in mixed_prompts(12, LENGTHS))


def run_parity(family: str, engine: Engine) -> Engine:
    prompts = mixed_prompts(12, LENGTHS)
    expected = litgpt_tokens(family)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    for prompt, result, want in zip(prompts, results, expected):
        assert result.token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert result.finish_reason == "length"
    return engine


LADDER = (16, 32)  # with max_seq_length 64: steps read 16, 32 or 64 cache entries


@pytest.mark.parametrize("ladder", [None, LADDER])
def test_eager_matches_litgpt(family, ladder):
    engine = Engine(tiny_gpt(family), EngineConfig(compile="eager", attention_lengths=ladder, **ENGINE_CONFIG))
    run_parity(family, engine)
    assert engine.stats()["generated_tokens"] == 12 * MAX_NEW
    assert engine.stats()["finished_requests"] == 12


@pytest.mark.regression
@pytest.mark.parametrize("family", ["pythia", "llama", "gemma2", "gemma2_window"])
def test_thunder_matches_litgpt(family, thunder_engine):
    engine = thunder_engine(family)
    run_parity(family, engine)
    # this traffic runs decode-only, 1- and 2-lane steps (never 4 slots reading prompts at once), all 64 entries
    assert engine.stats()["cache_misses"] == 3


@pytest.mark.regression
@pytest.mark.parametrize("family", ["llama", "gemma2_window"])
def test_thunder_matches_litgpt_with_an_attention_ladder(family):
    engine = Engine(tiny_gpt(family), EngineConfig(compile="thunder", attention_lengths=LADDER, **ENGINE_CONFIG))
    run_parity(family, engine)
    assert 2 < engine.stats()["cache_misses"] <= len(engine.config.step_shapes) == 12  # (0, 1, 2, 4 lanes) x 3 rungs


@torch.no_grad()
def test_litgpt_cached_softcapping_path_differs_from_uncached():
    """Why the Gemma-2 oracle is uncached: if litgpt fixes its bug, this fails and the oracle can change."""
    gpt = tiny_gpt("gemma2")
    model = copy.deepcopy(gpt)
    model.set_kv_cache(batch_size=1, max_seq_length=16)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    cached = model(prompt, input_pos=torch.arange(5))[0, -1]
    full = gpt(prompt)[0, -1]
    assert (cached - full).abs().max() > 1e-2
