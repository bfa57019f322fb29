"""Executor choice and CUDA graphs: selection errors anywhere, greedy parity with eager through
Engine.generate per executor (the trace shows who claimed the ops), and the CUDA-only paths, which
skip with a reason on machines without an NVIDIA GPU.

Tracing is the slow part (tens of seconds per step shape on a 2-core CPU): the models are 1-layer,
each traced engine is built once per module, and the torchcompile one uses a single step shape.
"""

from __future__ import annotations

import pytest

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch._compat import import_thunder
from thunder_batch.compile import step as compile_step
from thunder_batch.compile.executors import KNOWN_EXECUTORS, executor_availability, executor_claims, fusion_regions
from thunder_batch.compile.step import cache_misses, compile_options, execution_traces

from helpers import mixed_prompts, needs_cuda, tiny_gpt

SHAPE = dict(batch_size=2, max_seq_length=32, prefill_chunk=4)
LENGTHS = [1, 3, 6, 9, 2]  # 5 prompts through 2 slots: slots reused, prompts chunked and padded
PARAMS = SamplingParams(max_new_tokens=5)


def tiny(device: str = "cpu"):
    return tiny_gpt("llama", n_layer=1).to(device)


def greedy_tokens(engine: Engine, prompts) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts, PARAMS)]


def eager_tokens(prompts, device: str = "cpu", **shape) -> list[list[int]]:
    engine = Engine(tiny(device), EngineConfig(compile="eager", **(shape or SHAPE)))
    return greedy_tokens(engine, prompts)


@pytest.fixture(scope="module", autouse=True)
def fresh_compile_cache(tmp_path_factory):
    """Every engine here traces (a stored program from an earlier run would hide the trace)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("THUNDER_BATCH_CACHE_DIR", str(tmp_path_factory.mktemp("compile_cache")))
        yield


# -- selection: no tracing ------------------------------------------------------------------------
def test_unknown_executor_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown executor\(s\) \['nvfusr'\]") as info:
        Engine(tiny(), EngineConfig(executors=("nvfusr", "torch"), **SHAPE))
    for name in KNOWN_EXECUTORS:
        assert repr(name) in str(info.value)


def test_empty_executor_list_is_rejected():
    with pytest.raises(ValueError, match="executors is empty"):
        Engine(tiny(), EngineConfig(executors=(), **SHAPE))


def test_unavailable_nvfuser_is_reported():
    why = executor_availability()["nvfuser"]
    if why is None:
        pytest.skip("nvFuser is usable on this machine")
    assert "nvFuser" in why
    with pytest.raises(ValueError, match="not available here: nvfuser: nvFuser is") as info:
        Engine(tiny(), EngineConfig(executors=("nvfuser", "torch"), **SHAPE))
    assert "Available here: [" in str(info.value) and "'torch'" in str(info.value)


@pytest.mark.regression
def test_thunder_registers_the_executors_we_name():
    """torch, python, sdpa and torchcompile are Thunder executors under these names on any torch we
    pin; a renamed or dropped executor shows up here first."""
    availability = executor_availability()
    assert set(availability) == set(KNOWN_EXECUTORS)
    for name in ("torch", "python", "sdpa", "torchcompile"):
        assert availability[name] is None, f"{name}: {availability[name]}"


@pytest.mark.regression
def test_compile_options_enable_nvfuser_scatter_and_add_no_cuda_graph_transform(monkeypatch):
    import_thunder()  # the compat patches before thunder's own imports, also when this test runs alone
    monkeypatch.setattr(compile_step, "resolve_executors", lambda names: list(names))  # nvFuser needs no GPU here
    options = compile_options(EngineConfig(executors=("nvfuser", "torch"), cuda_graphs=True, trace="step"))
    assert options["executors"] == ["nvfuser", "torch"]
    assert options["nv_enable_scatter"] is True
    # CUDA graphs are taken around the composed step (compile/cuda_graphs.py): no transform in the pieces.
    assert [type(t).__name__ for t in options["transforms"]] == ["InplaceScatter"]
    plain = compile_options(EngineConfig(executors=("torchcompile", "torch")))
    assert "nv_enable_scatter" not in plain
    nvfuser_default = type("Executor", (), {"name": "nvfuser"})()  # nvFuser among Thunder's defaults (CUDA)
    with monkeypatch.context() as m:
        m.setattr(compile_step.executor_lists, "default_executors", lambda: [nvfuser_default])
        assert compile_options(EngineConfig())["nv_enable_scatter"] is True
    assert [type(t).__name__ for t in plain["transforms"]] == ["InplaceScatter"]
    # executors=None: the project's kernels, sdpa, (the Inductor fusion: left out by conftest here), torch,
    # then the rest of Thunder's defaults
    defaults = compile_options(EngineConfig())
    rest = [ex.name for ex in import_thunder().get_default_executors() if ex.name not in ("sdpa", "torch")]
    assert [ex.name for ex in defaults["executors"]] == ["thunder_batch", "sdpa", "torch", *rest]


def test_executors_and_cuda_graphs_need_thunder():
    with pytest.raises(ValueError, match="need compile='thunder'"):
        Engine(tiny(), EngineConfig(compile="eager", cuda_graphs=True, **SHAPE))
    with pytest.raises(ValueError, match="need compile='thunder'"):
        Engine(tiny(), EngineConfig(compile="eager", executors=("torch",), **SHAPE))


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device; it is on cpu"):
        Engine(tiny(), EngineConfig(cuda_graphs=True, trace="step", **SHAPE))


# -- parity per executor (traced) ---------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(len(LENGTHS), LENGTHS, seed=3)


@pytest.fixture(scope="module")
def eager_reference(prompts):
    return eager_tokens(prompts)


@pytest.fixture(scope="module")
def torch_engine():
    return Engine(tiny(), EngineConfig(executors=("torch",), **SHAPE))


@pytest.mark.regression
def test_torch_executor_matches_eager(torch_engine, prompts, eager_reference):
    assert greedy_tokens(torch_engine, prompts) == eager_reference
    assert cache_misses(torch_engine.runner.step_fn) == len(torch_engine.config.step_shapes)


@pytest.mark.regression
def test_torch_executor_claims_every_op(torch_engine, prompts):
    if cache_misses(torch_engine.runner.step_fn) == 0:
        greedy_tokens(torch_engine, prompts[:1])
    traces = execution_traces(torch_engine.runner.step_fn)
    claims = [executor_claims(trace) for trace in traces]
    # sdpa was not listed, so torch runs the attention too; the KV cache writes are our in-place op
    assert set().union(*claims) == {"torch", "thunder_batch"}, claims
    block_claims = [c for c in claims if "thunder_batch" in c]  # the block programs: K and V writes
    assert block_claims and all(c["thunder_batch"] == 2 for c in block_claims), claims
    assert all(fusion_regions(trace) == [] for trace in traces)


@pytest.mark.regression
def test_torchcompile_executor_matches_eager(prompts):
    """One step shape (chunk 1) keeps Inductor's CPU compile to about a minute."""
    shape = dict(SHAPE, prefill_chunk=1)
    engine = Engine(tiny(), EngineConfig(executors=("torchcompile", "torch"), **shape))
    assert greedy_tokens(engine, prompts) == eager_tokens(prompts, **shape)
    assert cache_misses(engine.runner.step_fn) == 1
    traces = execution_traces(engine.runner.step_fn)
    assert all(executor_claims(t).get("torchcompile", 0) >= 1 for t in traces), [executor_claims(t) for t in traces]
    assert all(any(name.startswith("TorchCompile") for name in fusion_regions(t)) for t in traces)


# -- CUDA only ------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.cuda
@pytest.mark.regression
def test_nvfuser_matches_eager_and_writes_the_cache_in_place(prompts):
    why = executor_availability()["nvfuser"]
    if why is not None:
        pytest.skip(f"nvFuser unavailable: {why}")
    engine = Engine(tiny("cuda"), EngineConfig(executors=("nvfuser", "torch"), **SHAPE))
    assert greedy_tokens(engine, prompts) == eager_tokens(prompts, "cuda")
    traces = execution_traces(engine.runner.step_fn)
    assert any(name.startswith("nvFusion") for t in traces for name in fusion_regions(t))
    unfused = [b.sym.name for t in traces for b in t.bound_symbols if not b.sym.is_fusion]
    # nvFuser does not claim index_copy: the KV write runs in place in our executor, never as a copy
    assert not [n for n in unfused if n in ("index_copy", "scatter")], unfused
