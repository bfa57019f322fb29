"""Slower paths are reported, never silent (thunder_batch.fallbacks): warned once per process, counted
every time, shown in `Engine.stats()["fallbacks"]`. The fusion's and CUDA graphs' fallbacks are tested
with them (test_fusion.py, test_cuda_graphs.py)."""

from __future__ import annotations

import warnings

import pytest

from thunder_batch import Engine, EngineConfig, fallbacks
from thunder_batch.moe import StackedExperts
from thunder_batch.native import build

from helpers import ENGINE_CONFIG, shrunk_config, tiny_family_gpt, tiny_gpt


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fallbacks, "_counts", fallbacks.Counter())
    monkeypatch.setattr(fallbacks, "_warned", set())


def test_a_fallback_warns_once_and_counts_every_time(fresh):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            fallbacks.report("region_strides", "a region ran its torch ops")
    assert [str(w.message).split(" (")[0] for w in caught] == ["a region ran its torch ops"]
    assert fallbacks.counts() == {"region_strides": 3}


def test_native_kernels_that_cannot_run_are_reported(fresh, monkeypatch):
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse2", "avx"})
    with pytest.warns(fallbacks.FallbackWarning, match="native CPU kernels unavailable .this CPU has no AVX2 and FMA"):
        assert build.unavailable.__wrapped__() == "this CPU has no AVX2 and FMA"
    assert fallbacks.counts() == {"native_kernels": 1}


def test_a_moe_layer_without_the_grouped_matmul_is_reported(fresh):
    odd = shrunk_config("Qwen3-30B-A3B", moe_intermediate_size=18)  # 18 wide: strides not multiples of 16 bytes
    with pytest.warns(fallbacks.FallbackWarning, match="grouped matmul does not run this mixture-of-experts"):
        assert not StackedExperts(tiny_family_gpt(odd).transformer.h[0].mlp).grouped_runs
    assert fallbacks.counts()["moe_layout"] >= 1


def test_the_engine_shows_the_counts(fresh):
    fallbacks.report("moe_layout", "a layer runs the dense layout")
    engine = Engine(tiny_gpt("llama"), EngineConfig(compile="eager", **ENGINE_CONFIG))
    assert engine.stats()["fallbacks"] == {"moe_layout": 1}
