"""The weights the engine runs are the model's own, however they change (thunder_batch.weights): edited in place,
replaced by new tensors (`load_state_dict(assign=True)`), given new data (`p.data = t`), written behind every
counter and announced (`refresh_weights`), or copied in (`update_weights`). A compiled engine whose layers run as
one native loop gives the eager engine's tokens step by step across each change, with no retrace; a kept prefix
is never reused after one; what cannot be followed (a new dtype, a replaced submodule) is refused and loses
nothing."""

from __future__ import annotations

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams, fallbacks
from thunder_batch.compile import layered
from thunder_batch.native import build
from thunder_batch.weights import WeightsChangedError

from helpers import mixed_prompts, tiny_gpt

needs_kernels = pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")

PROMPTS = mixed_prompts(3, [2, 5, 7])
# One step shape: prompts through the decode rows, one rung: every step is decode-only (the native loop's).
CONFIG = dict(batch_size=2, max_seq_length=32, prefill_chunk=4, prefill_lanes=0, attention_lengths=(32,))
NEW_TOKENS, CHANGE_AT = 14, 12  # both requests decoding, their layers one native call, when the weights change


def new_weights() -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in tiny_gpt("llama", seed=1).state_dict().items()}


@torch.no_grad()
def change(kind: str, gpt, engines) -> None:
    """Change `gpt`'s weights the `kind` way (every kind but in_place: to `new_weights()`)."""
    new = new_weights()
    if kind == "in_place":
        gpt.transformer.h[1].mlp.fc_2.weight.mul_(-1)
    elif kind == "load_state_dict":
        gpt.load_state_dict(new)
    elif kind == "assign":
        gpt.load_state_dict(new, assign=True)
    elif kind == "data":
        for name, p in gpt.named_parameters():
            p.data = new[name]
    elif kind == "data_copy":  # no counter sees it: the caller says so
        for name, p in gpt.named_parameters():
            p.data.copy_(new[name])
        for engine in engines:
            engine.refresh_weights()
    elif kind == "round_trip":  # new data twice between two steps: the second may land in the first's memory
        for name, p in gpt.named_parameters():
            p.data = new[name].to(torch.bfloat16)
        gpt.to(torch.float32)
    elif kind == "update_weights":
        for engine in engines:
            engine.update_weights(new)
    else:
        raise ValueError(kind)


KINDS = ["in_place", "load_state_dict", "assign", "data", "round_trip", "data_copy", "update_weights"]


def run_steps(engines, steps: int, at_step=None) -> dict:
    """Steps every engine in lockstep; `at_step(step)` runs before step `step`. Tokens per engine per request."""
    tokens = {engine: {} for engine in engines}
    for step in range(steps):
        if at_step is not None:
            at_step(step)
        for engine in engines:
            for out in engine.step():
                tokens[engine].setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def add_requests(engines) -> None:
    for engine in engines:
        for n, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), request_id=n)


@pytest.fixture(scope="module")
def unchanged_tokens() -> dict:
    """The eager engine's tokens with no change: each kind must change them, or its test could not fail."""
    engine = Engine(tiny_gpt("llama"), EngineConfig(**CONFIG, compile="eager"))
    add_requests([engine])
    return run_steps([engine], 24)[engine]


@needs_kernels
@pytest.mark.fusion
@pytest.mark.parametrize("kind", KINDS)
def test_a_compiled_engine_follows_every_kind_of_weight_change_step_by_step(kind, unchanged_tokens, tmp_path_factory):
    gpt = tiny_gpt("llama")
    compiled = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path_factory.getbasetemp() / "weights")))
    eager = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([compiled, eager])
    seen = {}

    def at_step(step):
        if step == CHANGE_AT:
            seen["stacked"], seen["traces"] = compiled.stats()["stacked_shapes"], compiled.stats()["thunder_traces"]
            change(kind, gpt, [compiled, eager])

    tokens = run_steps([compiled, eager], 24, at_step)
    assert tokens[compiled] == tokens[eager]
    assert [len(t) for t in tokens[eager].values()] == [NEW_TOKENS] * 2
    assert tokens[eager] != unchanged_tokens  # the change shows in the tokens after it
    stats = compiled.stats()
    assert seen["stacked"] == 1 and stats["stacked_shapes"] == 1  # the native loop ran before and after
    assert stats["thunder_traces"] == seen["traces"]  # nothing retraced


@needs_kernels
@pytest.mark.fusion
def test_a_new_dtype_is_refused_by_both_engines_and_loses_nothing(tmp_path_factory):
    """`model.to(torch.bfloat16)` on a live fp32 engine: refused at the next step, naming the weight and the dtype,
    with nothing advanced; once the model is float32 again (its values rounded through bfloat16), both engines
    go on with the same tokens and every request completes."""
    gpt = tiny_gpt("llama")
    compiled = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path_factory.getbasetemp() / "weights")))
    eager = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([compiled, eager])
    before = run_steps([compiled, eager], 6)
    traces = compiled.stats()["thunder_traces"]
    gpt.to(torch.bfloat16)
    for engine in (compiled, eager):
        for _ in range(2):  # refused each time, until the model is put back
            with pytest.raises(WeightsChangedError, match=r"weight .* float32 on cpu to .* bfloat16 on cpu"):
                engine.step()
        assert engine.stats()["steps"] == 6
    gpt.to(torch.float32)
    after = run_steps([compiled, eager], 20)
    assert before[compiled] == before[eager] and after[compiled] == after[eager]
    done = {n: before[eager][n] + after[eager][n] for n in after[eager]}
    assert [len(t) for t in done.values()] == [NEW_TOKENS] * 2
    assert compiled.stats()["thunder_traces"] == traces


def test_a_replaced_submodule_is_refused_and_loses_nothing(unchanged_tokens):
    gpt = tiny_gpt("llama")
    engine = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([engine])
    head = gpt.lm_head

    def at_step(step):
        if step == 4:
            gpt.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=False)
            with pytest.raises(WeightsChangedError, match="submodule 'lm_head'"):
                engine.step()
            gpt.lm_head = head

    assert run_steps([engine], 24, at_step)[engine] == unchanged_tokens


def test_a_removed_weight_is_refused_and_loses_nothing(unchanged_tokens):
    gpt = tiny_gpt("llama")
    engine = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([engine])
    fc = gpt.transformer.h[1].mlp.fc_1

    def at_step(step):
        if step == 4:
            weight, fc.weight = fc.weight, None
            with pytest.raises(WeightsChangedError, match=r"weight transformer.h.1.mlp.fc_1.weight was removed"):
                engine.step()
            fc.weight = weight

    assert run_steps([engine], 24, at_step)[engine] == unchanged_tokens


@pytest.mark.parametrize("compile_mode", ["eager", "thunder"])
@pytest.mark.parametrize("kind", ["in_place", "assign", "data", "data_copy", "update_weights"])
def test_no_kept_prefix_is_reused_after_a_weight_change(kind, compile_mode, tmp_path_factory):
    """A conversation's next turn after the weights changed gets a fresh engine's answer on the new weights:
    no cache entry computed by the old ones is reused."""
    gpt = tiny_gpt("llama")
    config = EngineConfig(**CONFIG, compile=compile_mode, cache_dir=str(tmp_path_factory.getbasetemp() / "prefix"))
    engine = Engine(gpt, config)
    first = PROMPTS[2]
    [reply] = engine.generate([first], SamplingParams(max_new_tokens=6))
    turn = first + reply.token_ids + PROMPTS[0]
    change(kind, gpt, [engine])
    got = engine.generate([turn], SamplingParams(max_new_tokens=6))[0].token_ids
    assert engine.stats()["prompt_tokens_reused"] == 0
    fresh = Engine(gpt, EngineConfig(**CONFIG, compile="eager", prefix_reuse=False))
    assert got == fresh.generate([turn], SamplingParams(max_new_tokens=6))[0].token_ids


@needs_kernels
@pytest.mark.fusion
def test_the_native_loop_is_checked_against_the_layer_programs_before_it_runs(monkeypatch, tmp_path_factory):
    """The loop's first run (the step it was recorded from, again) must give the programs' output bit for bit;
    one that does not is never used (reported), and the layers' programs go on giving eager's tokens."""
    real = layered.BlockStack.__call__
    monkeypatch.setattr(layered.BlockStack, "__call__", lambda self, x, shared: real(self, x, shared) + 1e-3)
    before = fallbacks.counts().get("native_loop", 0)
    gpt = tiny_gpt("llama")
    compiled = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path_factory.getbasetemp() / "weights")))
    eager = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([compiled, eager])
    with pytest.warns(fallbacks.FallbackWarning, match="native loop") if before == 0 else _nothing():
        tokens = run_steps([compiled, eager], 24)
    assert tokens[compiled] == tokens[eager]
    assert compiled.stats()["stacked_shapes"] == 0 and fallbacks.counts()["native_loop"] == before + 1


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_a_prompt_whose_last_token_is_fed_in_a_verify_lane_counts_every_prompt_token():
    engine = Engine(tiny_gpt("llama"), EngineConfig(**CONFIG, speculative_tokens=3, compile="eager"))
    engine.generate([[7, 8, 9, 7, 8]], SamplingParams(max_new_tokens=6))
    stats = engine.stats()
    assert stats["speculative"]["verify_steps"] >= 1 and stats["prompt_tokens"] == 5


def test_update_weights_checks_every_name_and_shape_before_writing_any():
    gpt = tiny_gpt("llama")
    engine = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    new, before = new_weights(), {name: t.clone() for name, t in gpt.state_dict().items()}
    with pytest.raises(ValueError, match="no weight named 'lm_head.bias'"):
        engine.update_weights([*new.items(), ("lm_head.bias", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"transformer.wte.weight is \[256, 64\], got \[3\]"):
        engine.update_weights({**new, "transformer.wte.weight": torch.zeros(3)})
    assert all(torch.equal(t, before[name]) for name, t in gpt.state_dict().items())
    engine.update_weights(iter(new.items()))  # pairs from any iterable
    assert all(torch.equal(t, new[name]) for name, t in gpt.state_dict().items())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 32), (37, 20), (5, 6)])
def test_a_packed_copy_refreshed_in_its_own_memory_equals_a_fresh_one(dtype, shape):
    from thunder_batch.compile.project_executor import PackedWeights

    w = torch.randn(shape).to(dtype)
    packed_weights = PackedWeights()
    packed, _ = packed_weights.get(w)
    with torch.no_grad():
        w.copy_(torch.randn(shape))
    packed_weights.refresh([w])
    assert packed_weights.holds(w) and packed_weights.get(w)[0] is packed
    assert torch.equal(packed, PackedWeights._pack(w)[0])


@pytest.mark.parametrize("kind", ["in_place", "assign", "data"])
def test_moe_expert_stacks_follow_the_models_experts(kind):
    """An MoE layer runs its experts from one stack the model's expert weights view (moe.py); weights replaced
    by new tensors or new data are copied back into the stack. With speculative decoding the verify program
    shares the stacks, so an edit in place reaches both. A request after the change gets litgpt's greedy tokens
    on the changed model."""
    from helpers import assert_litgpt_greedy, shrunk_config, tiny_family_gpt

    gpt = tiny_family_gpt(shrunk_config("Mixtral-8x7B-v0.1"))
    engine = Engine(gpt, EngineConfig(**CONFIG, compile="eager", speculative_tokens=2, prefix_reuse=False))
    engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=4))
    expert = gpt.transformer.h[0].mlp.experts[1].fc_1
    with torch.no_grad():
        if kind == "in_place":
            expert.weight.mul_(-3)
        elif kind == "assign":
            expert.weight = torch.nn.Parameter(expert.weight * -3)
        else:
            expert.weight.data = expert.weight * -3
    prompts = [PROMPTS[1], PROMPTS[2] * 2]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=10))
    with torch.no_grad():
        assert_litgpt_greedy(gpt, prompts, results)


def test_a_whole_step_trace_follows_new_tensors(unchanged_tokens):
    """trace="step": Thunder's module keeps a table of the parameters it was made with; it is made again."""
    gpt = tiny_gpt("llama")
    compiled = Engine(gpt, EngineConfig(**CONFIG, trace="step"))
    eager = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    add_requests([compiled, eager])
    tokens = run_steps([compiled, eager], 24, lambda step: step == CHANGE_AT and change("assign", gpt, []))
    assert tokens[compiled] == tokens[eager] and [len(t) for t in tokens[eager].values()] == [NEW_TOKENS] * 2
    assert tokens[eager] != unchanged_tokens
