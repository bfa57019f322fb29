"""The caller's model after an Engine: the engine reads its weights and changes nothing of it (no KV
caches attached, no max_seq_length, no eval/requires_grad switch, no RoPE tables rebuilt), during
the engine's life and after it is dropped; the model keeps giving litgpt's own outputs."""

from __future__ import annotations

import gc

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams

from helpers import ENGINE_CONFIG, litgpt_greedy, mixed_prompts, tiny_gpt


def snapshot(gpt) -> dict:
    """Everything of the model an engine could change: tensors, flags, attributes litgpt reads."""
    return dict(
        state={k: v.clone() for k, v in gpt.state_dict(keep_vars=False).items()},
        buffers={k: v.clone() for k, v in gpt.named_buffers()},
        max_seq_length=gpt.max_seq_length,
        training=[m.training for m in gpt.modules()],
        requires_grad=[p.requires_grad for p in gpt.parameters()],
        kv_caches=[block.attn.kv_cache for block in gpt.transformer.h],
        modules=[type(m).__name__ for m in gpt.modules()],
        attributes=sorted(vars(gpt)),
    )


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in ("state", "buffers"):
        assert a[key].keys() == b[key].keys(), key
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    for key in ("max_seq_length", "training", "requires_grad", "modules", "attributes"):
        assert a[key] == b[key], key
    assert all(x is y for x, y in zip(a["kv_caches"], b["kv_caches"]))


@pytest.mark.parametrize("compile", ["eager", "thunder"])
def test_engine_leaves_the_callers_model_as_it_was(compile):
    gpt = tiny_gpt("llama").train()  # a model still in training mode, parameters requiring grad
    prompts = mixed_prompts(3, [2, 7, 11])
    with torch.no_grad():
        forward_before = gpt(torch.tensor([prompts[1]]))
    before = snapshot(gpt)
    engine = Engine(gpt, EngineConfig(compile=compile, **ENGINE_CONFIG))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    assert_same(before, snapshot(gpt))
    assert [r.token_ids for r in results] == [litgpt_greedy(gpt, p, 5) for p in prompts]
    del engine, results
    gc.collect()
    assert_same(before, snapshot(gpt))
    with torch.no_grad():
        assert torch.equal(gpt(torch.tensor([prompts[1]])), forward_before)


def test_engine_shares_the_weights_not_a_copy():
    """The engine reads the caller's parameters in place: an edit to them shows in its next outputs."""
    gpt = tiny_gpt("llama")
    engine = Engine(gpt, EngineConfig(compile="eager", **ENGINE_CONFIG))
    prompt = mixed_prompts(1, [6])[0]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    with torch.no_grad():
        gpt.lm_head.weight.mul_(-1)  # reverses every logit's order
    second = engine.generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    assert second == litgpt_greedy(gpt, prompt, 4) and second != first
