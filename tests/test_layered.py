"""The step traced piece by piece: layers share a block trace exactly when Thunder's prologue
checks allow, outputs stay bit-identical to eager and to the whole-step trace, and a stored
layout is only used for layers whose checks pass."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.cache import CompileCacheWarning
from thunder_batch.compile.project_executor import PACKED, ProjectKernelsMode, own_layout
from thunder_batch.step_plan import StepPlan

from helpers import mixed_prompts, tiny_gpt

CONFIG = dict(batch_size=3, max_seq_length=48, prefill_chunk=4, prefill_lanes=2)
# (rows, entries read): decode only; 3 decode rows + 1 lane of 4; + 2 lanes; + 3 lanes (every slot reading a prompt)
SHAPES = [(3, 48), (3 + 4, 48), (3 + 2 * 4, 48), (3 + 3 * 4, 48)]
BLOCK_IDX = (("submodule", "block.attn"), ("attr", "block_idx"))


def run(engine: Engine) -> list:
    """Greedy and sampled requests (both heads); tokens and logprobs, bit for bit. An eager engine runs
    with the kernels the Thunder engines' executor claims (ProjectKernelsMode), so the two compare exactly."""
    prompts = mixed_prompts(6, [1, 3, 6, 11])
    params = [
        SamplingParams(max_new_tokens=5, temperature=[0.0, 0.9, 0.7][i % 3], top_p=[1.0, 1.0, 0.8][i % 3], seed=i)
        for i in range(6)
    ]
    with ProjectKernelsMode() if engine.config.compile == "eager" else contextlib.nullcontext():
        results = engine.generate(prompts, params)
    return [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in results]


def engine_for(gpt, tmp_path, **config) -> Engine:
    """A Thunder engine with every piece made up front (every head at both shapes)."""
    engine = Engine(gpt, EngineConfig(**{**CONFIG, **config}, cache_dir=str(tmp_path)))
    engine.warmup()
    return engine


def block_programs(engine: Engine, shape: tuple[int, int]) -> list[int]:
    """For each layer, which distinct computation runs it at this shape (0, 1, ... in order of use)."""
    blocks = engine.runner.step_fn._shapes[shape].blocks
    ids = [id(blocks[i].computation) for i in range(len(blocks))]
    return [list(dict.fromkeys(ids)).index(i) for i in ids]


@pytest.mark.regression
def test_uniform_layers_share_one_block_trace(tmp_path):
    engine = engine_for(tiny_gpt("llama", n_layer=4), tmp_path)
    assert run(engine) == run(Engine(tiny_gpt("llama", n_layer=4), EngineConfig(compile="eager", **CONFIG)))
    assert [block_programs(engine, w) for w in SHAPES] == [[0, 0, 0, 0]] * len(SHAPES)
    stats = engine.stats()
    assert stats["programs"] == {"prefix": 4, "block": 4, "head-filtered": 4, "head-unsorted": 4, "head-greedy": 4}
    # At the first shape, layer 1 is traced once more: its trace equals layer 0's, so the value their
    # checks differ on (litgpt's block_idx) is learned not to matter; no other layer traces anything.
    assert engine.runner.step_fn.traced["block"] == 4
    assert engine.runner.step_fn.traced["block (same as an earlier layer)"] == 1
    assert engine.runner.step_fn.ignored == {BLOCK_IDX}
    assert stats["thunder_traces"] == 4 + 4 + 1 + 12  # Thunder's own count agrees: each piece traced once


@pytest.mark.parametrize("compile", ["eager", "thunder"])
def test_warmup_runs_the_layers_once_per_shape_and_every_head_on_their_output(compile, tmp_path):
    engine = Engine(tiny_gpt("llama"), EngineConfig(**CONFIG, compile=compile, cache_dir=str(tmp_path)))
    runner, runs = engine.runner, []
    if compile == "eager":  # count layer 0's runs
        hook = runner.program.blocks[0].register_forward_hook(lambda *_: runs.append(1))
        engine.warmup()
        hook.remove()
        layer_runs = len(runs)
    else:  # a hook would enter the traces: each call of the layered program runs every layer once
        engine.warmup()
        layer_runs = runner.step_fn.calls
        assert engine.stats()["programs"]["head-greedy"] == len(SHAPES)  # every head made at every N
    assert layer_runs == len(SHAPES)
    # The heads of one warm-up call give what each head gives on its own (an empty step writes scratch only).
    args = tuple(runner.inputs_for(StepPlan([]), runner.config.step_shapes[0]))
    together = runner.step_fn(*args, head=("greedy", "filtered"))
    alone = [runner.step_fn(*args, head=h) for h in ("greedy", "filtered")]
    assert [[t.tolist() for t in out] for out in together] == [[t.tolist() for t in out] for out in alone]


def test_a_warm_up_runs_a_stored_block_on_its_first_layer_only(tmp_path, monkeypatch):
    """A warm-up's outputs are thrown away: a layer whose program an earlier layer ran is bound, not run
    (at fp32 B=64 those runs were 9 of a 19 s warm start). Loaded from the store, a shape's
    block runs twice in a warm-up (its load-time check, then its first run), not once per layer; the steps
    after it run every layer and equal eager."""
    from collections import Counter

    from thunder_batch.compile.trace_export import BoundComputation

    engine_for(tiny_gpt("llama", n_layer=4), tmp_path)  # fills the store
    runs, call = Counter(), BoundComputation.__call__

    def counting(self, *args):
        runs["block" if self.writes else "other"] += 1  # a block writes its layer's KV cache
        return call(self, *args)

    monkeypatch.setattr(BoundComputation, "__call__", counting)
    engine = engine_for(tiny_gpt("llama", n_layer=4), tmp_path)
    assert engine.stats()["traced"] == 0
    assert runs["block"] == 2 * len(SHAPES)  # one check and one run per shape (5 with every layer run)
    monkeypatch.undo()
    assert run(engine) == run(Engine(tiny_gpt("llama", n_layer=4), EngineConfig(compile="eager", **CONFIG)))


@pytest.mark.parametrize("stored", [False, True])
def test_a_warm_up_packs_the_weights_of_the_layers_it_binds_without_running(tmp_path, stored):
    """Every layer's linear weights are packed by the warm-up, traced or loaded, not by the first real
    step (it packed every layer after the first: ~2.3 s in a server's first decode step, default model)."""
    if stored:
        engine_for(tiny_gpt("llama", n_layer=4), tmp_path)  # fills the store
    engine = engine_for(tiny_gpt("llama", n_layer=4), tmp_path)
    assert (engine.stats()["traced"] == 0) == stored
    weights = [m.weight for m in engine.runner.program.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 4 * 5 + 1  # qkv, proj, fc_1, fc_2, mlp proj per layer, and the lm head
    assert all(PACKED.holds(w) for w in weights)
    # where the kernel reads a weight in its own layout (an AVX2 CPU), what it "packed" is the weight's memory
    assert all((PACKED.get(w)[0].data_ptr() == w.data_ptr()) == own_layout(w) for w in weights)
    packs, pack = [], PACKED._pack
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PACKED, "_pack", lambda w: packs.append(w) or pack(w))
        engine.generate(mixed_prompts(3, [2, 5]), SamplingParams(max_new_tokens=3))
    assert packs == []


def test_a_warm_up_checks_a_stored_head_without_running_it_again(tmp_path, monkeypatch):
    """A loaded head's load-time check runs it; a warm-up throws the outputs away and a head has no
    compiled regions to load, so it is not run a second time (at fp32 B=64 a head's run is ~0.1 s: the
    logits and the sampler's sort). The steps after the warm-up run every head they pick and equal eager."""
    import torch

    from thunder_batch.compile.trace_export import BoundComputation

    engine_for(tiny_gpt("llama"), tmp_path)  # fills the store
    head_runs, call = [0], BoundComputation.__call__

    def counting(self, *args):
        out = call(self, *args)
        first = out[0] if isinstance(out, (tuple, list)) else out
        head_runs[0] += first.dtype == torch.int64  # a head returns the sampled tokens first
        return out

    monkeypatch.setattr(BoundComputation, "__call__", counting)
    engine = engine_for(tiny_gpt("llama"), tmp_path)
    stats = engine.stats()
    assert stats["traced"] == 0
    loaded_heads = sum(n for kind, n in stats["programs"].items() if kind.startswith("head"))
    assert loaded_heads >= 3 and head_runs[0] == loaded_heads  # each checked once (twice with the run after it)
    monkeypatch.undo()
    assert run(engine) == run(Engine(tiny_gpt("llama"), EngineConfig(compile="eager", **CONFIG)))


@pytest.mark.regression
def test_a_layer_with_a_different_attribute_gets_its_own_trace(tmp_path):
    def model():
        gpt = tiny_gpt("llama", n_layer=4)
        gpt.transformer.h[2].norm_1.eps = 0.5  # a plain attribute Thunder bakes into the trace
        return gpt

    eager = run(Engine(model(), EngineConfig(compile="eager", **CONFIG)))
    assert eager != run(Engine(tiny_gpt("llama", n_layer=4), EngineConfig(compile="eager", **CONFIG)))  # it matters
    engine = engine_for(model(), tmp_path)
    assert run(engine) == eager
    assert [block_programs(engine, w) for w in SHAPES] == [[0, 0, 1, 0]] * len(SHAPES)


@pytest.mark.regression
def test_alternating_sliding_windows_get_two_block_traces(tmp_path):
    engine = engine_for(tiny_gpt("gemma2_window"), tmp_path)
    assert run(engine) == run(Engine(tiny_gpt("gemma2_window"), EngineConfig(compile="eager", **CONFIG)))
    assert [block_programs(engine, w) for w in SHAPES] == [[0, 1, 0, 1]] * len(SHAPES)


@pytest.mark.regression
def test_whole_step_trace_gives_the_same_outputs(tmp_path):
    layered = run(engine_for(tiny_gpt("pythia"), tmp_path))
    whole = Engine(tiny_gpt("pythia"), EngineConfig(**CONFIG, trace="step"))
    whole.warmup()
    assert run(whole) == layered
    assert whole.stats()["programs"] == {"step": 4}  # one whole trace per shape, always with the sort


def test_trace_modes_are_checked():
    with pytest.raises(ValueError, match="trace must be one of"):
        EngineConfig(trace="blocks")


@pytest.mark.regression
def test_stored_layout_is_used_only_where_its_checks_pass(tmp_path):
    """A warm start loads every piece; a layer changed since (same tensors, so the same keys) fails
    its stored program's checks and is traced, without a warning, while the others still load."""
    cold = engine_for(tiny_gpt("llama", n_layer=4), tmp_path)
    want = run(cold)
    warm = engine_for(tiny_gpt("llama", n_layer=4), tmp_path)
    assert run(warm) == want
    assert (warm.stats()["traced"], warm.stats()["disk_cache_hits"], warm.stats()["thunder_traces"]) == (0, 20, 0)

    def changed():
        gpt = tiny_gpt("llama", n_layer=4)
        gpt.transformer.h[3].norm_2.eps = 0.5
        return gpt

    engine = engine_for(changed(), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        outputs = run(engine)
    assert outputs == run(Engine(changed(), EngineConfig(compile="eager", **CONFIG)))
    assert [block_programs(engine, w) for w in SHAPES] == [[0, 0, 0, 1]] * len(SHAPES)
    assert engine.runner.step_fn.traced == {"block": 4}  # layer 3 at each shape; everything else loaded
    assert engine.stats()["thunder_traces"] == 4
