"""The default executors' Inductor fusion (compile.fusion): litgpt's tokens on several families, the
KV cache writes left in place outside the regions, the compiled regions stored with the pieces and
loaded by a fresh engine without compiling anything, and a damaged or unsafe region compiled again
with one warning. Each Inductor compile costs seconds on this CPU: one step shape, tiny models."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.attention import DECODE_BLOCK, ROWS_ATTENTION
from thunder_batch.compile.cache import CompileCacheWarning
from thunder_batch.compile.fused_region import FusedRegion, regions_of
from thunder_batch.compile.fusion import REGION_PREFIX
from thunder_batch.compile.inplace import INDEX_COPY_OPERATOR
from thunder_batch.compile.step import execution_traces

from helpers import litgpt_greedy, mixed_prompts, tiny_gpt

pytestmark = [pytest.mark.fusion, pytest.mark.regression]
# One step shape: no prefill lanes (prompts through the decode rows), one rung.
CONFIG = dict(batch_size=2, max_seq_length=32, prefill_chunk=4, prefill_lanes=0, attention_lengths=(32,))
PROMPTS = mixed_prompts(3, [2, 5, 7])
REGIONS = "pythia"  # its decode blocks are fused regions (a llama block is one native op: compile.block_op)


def engine(family: str, cache_dir) -> Engine:
    return Engine(tiny_gpt(family), EngineConfig(**CONFIG, cache_dir=str(cache_dir)))


def greedy(engine: Engine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))]


def regions(engine: Engine) -> list[FusedRegion]:
    """The shape's fusion regions, each once (layers of one kind share one block program)."""
    blocks = engine.runner.step_fn._shapes[(2, 32)].blocks.values()
    return list({id(r): r for b in blocks for r in regions_of(b.computation)}.values())


@pytest.mark.parametrize("family", ["llama", "pythia", "gemma2"])
def test_fused_step_gives_litgpt_tokens_and_writes_the_cache_in_place(family, tmp_path):
    fused = engine(family, tmp_path)
    assert greedy(fused) == [litgpt_greedy(tiny_gpt(family), p, 5) for p in PROMPTS]
    traces = execution_traces(fused.runner.step_fn)
    writes = (DECODE_BLOCK, ROWS_ATTENTION, INDEX_COPY_OPERATOR)
    block = next(t for t in traces if any(b.sym.name in writes for b in t.bound_symbols))
    names = [b.sym.name for b in block.bound_symbols]
    counts = tuple(names.count(op) for op in writes)
    if family == "llama":  # a llama-shaped decode block is one native op (compile.block_op), writes included
        assert counts == (1, 0, 0) and not any(n.startswith(REGION_PREFIX) for n in names)
    else:
        assert any(n.startswith(REGION_PREFIX) for n in names)  # elementwise work fused
        # K and V written in place, outside any region: by the one-op decode attention (decode-only steps),
        # or two index copies where it does not run (Gemma-2's softcapped attention)
        assert counts == ((0, 1, 0) if family == "pythia" else (0, 0, 2))
    assert fused.stats()["not_stored"] == 0


def test_a_fresh_engine_loads_the_compiled_regions_and_compiles_nothing(tmp_path, monkeypatch):
    first = engine(REGIONS, tmp_path)
    tokens = greedy(first)
    assert sorted((tmp_path / "inductor").glob("*.bin"))  # the compiled regions, stored

    def no_compiling(*args, **kwargs):
        raise AssertionError("a stored region was compiled again")

    monkeypatch.setattr(torch._inductor, "standalone_compile", no_compiling)
    second = engine(REGIONS, tmp_path)
    assert greedy(second) == tokens
    stats = second.stats()
    assert stats["traced"] == 0 and stats["disk_cache_hits"] > 0
    assert regions(second) and all(r.loaded for r in regions(second))


@pytest.mark.parametrize("damage", ["edit", "group-writable"])
def test_a_damaged_or_unsafe_region_is_compiled_again_with_one_warning(tmp_path, damage):
    tokens = greedy(engine(REGIONS, tmp_path))
    loading = engine(REGIONS, tmp_path)
    greedy(loading)
    victim = tmp_path / "inductor" / f"{regions(loading)[0].digest}.bin"  # a block region a fresh engine loads
    if damage == "edit":
        victim.write_bytes(victim.read_bytes()[:-64] + b"\0" * 64)
    else:
        os.chmod(victim, 0o664)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = engine(REGIONS, tmp_path)
        assert greedy(again) == tokens
    messages = [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)]
    assert len(messages) == 1 and victim.name in messages[0], messages
    assert sum(not r.loaded for r in regions(again)) == 1


def test_the_simd_probe_runs_in_inductors_own_place_before_its_caches_move_under_the_root(tmp_path, monkeypatch):
    from torch._inductor import cpu_vec_isa

    from thunder_batch.compile.fused_region import artifacts_in

    probed_in = []
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    def probe():
        probed_in.append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", probe)
    with artifacts_in(tmp_path):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "inductor-cache").absolute())
    assert probed_in == [None]  # probed once, where every compile root's builds find its test builds


def test_heads_are_keyed_on_the_executors_they_are_traced_with(tmp_path):
    """Heads are traced without the fusion: their entries name the executors actually used."""
    import json

    greedy(engine("llama", tmp_path))
    keys = [json.loads(p.read_text())["key"] for p in tmp_path.glob("*.json")]
    executors = {k["piece"]: k["executors"] for k in keys}
    assert "inductor" in executors["block"] and "inductor" in executors["prefix"]
    heads = [piece for piece in executors if piece.startswith("head-")]
    assert heads and all("inductor" not in executors[h] for h in heads)


@pytest.fixture
def fresh_fallbacks(monkeypatch):
    from thunder_batch import fallbacks

    monkeypatch.setattr(fallbacks, "_counts", fallbacks.Counter())
    monkeypatch.setattr(fallbacks, "_warned", set())
    return fallbacks


def test_without_a_compiler_regions_run_unfused_with_one_warning(tmp_path, monkeypatch, fresh_fallbacks):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C++ compiler")

    monkeypatch.setattr(torch._inductor, "standalone_compile", no_compiler)
    unfused = engine(REGIONS, tmp_path)
    with pytest.warns(fresh_fallbacks.FallbackWarning, match="could not be compiled") as caught:
        assert greedy(unfused) == [litgpt_greedy(tiny_gpt(REGIONS), p, 5) for p in PROMPTS]
    assert len([w for w in caught if issubclass(w.category, fresh_fallbacks.FallbackWarning)]) == 1
    assert unfused.stats()["fallbacks"]["unfused_region"] > 0  # each region, at each shape it ran
    assert not list((tmp_path / "inductor").glob("*.bin"))


def test_on_a_full_disk_regions_run_compiled_and_are_not_stored(tmp_path, monkeypatch, fresh_fallbacks):
    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    from torch._inductor.standalone_compile import CacheCompiledArtifact

    monkeypatch.setattr(CacheCompiledArtifact, "save", full_disk)  # what standalone_compile returns
    fused = engine(REGIONS, tmp_path)
    with pytest.warns(fresh_fallbacks.FallbackWarning, match="could not be stored"):
        assert greedy(fused) == [litgpt_greedy(tiny_gpt(REGIONS), p, 5) for p in PROMPTS]
    fallbacks = fused.stats()["fallbacks"]
    assert fallbacks["region_unsaved"] > 0 and "unfused_region" not in fallbacks  # compiled all the same
    assert not list((tmp_path / "inductor").glob("*.bin"))


TWICE_PLUS_ONE = "import torch\n\ndef fused_region(x):\n  return (torch.add(torch.mul(x, 2), 1),)\n"
THRICE = "import torch\n\ndef fused_region(x):\n  return (torch.mul(x, 3),)\n"


def test_a_region_traced_afresh_checks_the_artifact_it_finds(tmp_path):
    """A region traced afresh (no stored piece naming its artifact's hash) finds its artifact by digest:
    a damaged one fails the hash written beside it at save time; another region's artifact, with its
    own valid hash, fails the comparison with the region's torch ops. Each: one warning, compiled again."""
    from thunder_batch.compile.fused_region import artifacts_in, make_region

    x = torch.randn(4, 6)
    with artifacts_in(tmp_path), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = [make_region("InductorFusion0", source, {}) for source in (TWICE_PLUS_ONE, THRICE)]
        assert [torch.equal(r(x)[0], want) for r, want in zip(made, (x * 2 + 1, x * 3))] == [True, True]
        path = tmp_path / "inductor" / f"{made[0].digest}.bin"
        path.write_bytes(path.read_bytes()[:-64] + b"\0" * 64)  # damaged
        again = make_region("InductorFusion0", TWICE_PLUS_ONE, {})
        assert torch.equal(again(x)[0], x * 2 + 1) and not again.loaded
        other = tmp_path / "inductor" / f"{made[1].digest}"
        path.write_bytes(other.with_suffix(".bin").read_bytes())  # another region's artifact and its hash
        path.with_suffix(".sha256").write_bytes(other.with_suffix(".sha256").read_bytes())
        swapped = make_region("InductorFusion0", TWICE_PLUS_ONE, {})
        assert torch.equal(swapped(x)[0], x * 2 + 1) and torch.equal(swapped(x)[0], x * 2 + 1)
    messages = [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)]
    assert len(messages) == 2 and "content hash mismatch" in messages[0] and "torch ops" in messages[1], messages


def test_a_region_called_with_other_strides_runs_its_torch_ops_and_says_so(tmp_path, fresh_fallbacks):
    from thunder_batch.compile.fused_region import artifacts_in, make_region

    with artifacts_in(tmp_path):
        region = make_region("InductorFusion0", TWICE_PLUS_ONE, {})
        x = torch.randn(4, 6)
        assert torch.equal(region(x)[0], x * 2 + 1)
        other = torch.randn(6, 4).t()  # the same shape, transposed strides
        with pytest.warns(fresh_fallbacks.FallbackWarning, match="other strides"):
            assert torch.equal(region(other)[0], other * 2 + 1)
    assert fresh_fallbacks.counts() == {"region_strides": 1}


# An output that is a view of the input (AOTAutograd's wrapper makes such views again on every call).
ROWS_AND_PLUS_ONE = (
    "import torch\n\ndef fused_region(x):\n"
    "  return (torch.Tensor.__getitem__(x, (slice(1, None, None),)), torch.add(x, 1))\n"
)


def test_after_its_first_call_a_region_runs_its_generated_code_without_aotautograds_wrapper(tmp_path, monkeypatch):
    """Compiled or loaded, a region's calls after the first skip AOTAutograd's runtime wrappers (half a
    small region's host time) with the wrapped call's outputs: equal values, the same views of its input,
    the same profiler event. A direct call that disagrees with the wrapped one on the first call is never used."""
    from thunder_batch import _compat
    from thunder_batch.compile.fused_region import artifacts_in, make_region

    x = torch.randn(3, 8)
    with artifacts_in(tmp_path):
        for made in (make_region("InductorFusion0", ROWS_AND_PLUS_ONE, {}) for _ in range(2)):  # compiled, loaded
            outputs = [made(x) for _ in range(3)]
            assert made.call is not None and made.call is not made.compiled
            for rows, plus_one in outputs:
                assert rows.data_ptr() == x[1:].data_ptr() and rows.stride() == x[1:].stride()
                assert torch.equal(rows, x[1:]) and torch.equal(plus_one, x + 1)
        assert made.loaded
        with torch.profiler.profile() as profiled:
            made(x)
        assert [e.name for e in profiled.events() if "CompiledFxGraph" in e.name]  # a profile still shows it

        monkeypatch.setattr(_compat, "inductor_graph_call", lambda c: lambda *a: [t + 1 for t in c(*a)])
        disagreeing = make_region("InductorFusion0", ROWS_AND_PLUS_ONE, {})
        for _ in range(3):
            rows, plus_one = disagreeing(x)
            assert torch.equal(rows, x[1:]) and torch.equal(plus_one, x + 1)
        assert disagreeing.call is disagreeing.compiled
