"""The tracing shortcuts change how long Thunder takes, never what it produces: every piece the layered
program traces in production (prefix, blocks, heads, at each step shape) is the same program with
and without them."""

from __future__ import annotations

import re

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch._compat import import_thunder
from thunder_batch.compile import trace_speedups

from helpers import VOCAB, mixed_prompts, tiny_gpt

CONFIG = dict(batch_size=2, max_seq_length=16, prefill_chunk=4)  # 3 step shapes: decode only, 1 and 2 lanes of 4
TIMING = re.compile(r" \(took \d+ milliseconds\)")  # the one line of a trace that differs run to run


@pytest.fixture
def shortcuts(monkeypatch):
    """switch(on): trace with the shortcuts or, as THUNDER_BATCH_FAST_TRACE=0 asks, without them;
    left as found after the test."""
    was_on = bool(trace_speedups._installed)

    def switch(on: bool) -> None:
        trace_speedups.uninstall()
        monkeypatch.setenv("THUNDER_BATCH_FAST_TRACE", "1" if on else "0")

    yield switch
    trace_speedups.uninstall()
    monkeypatch.undo()
    if was_on:
        trace_speedups.install()


def traced_engine(gpt, cache_dir) -> Engine:
    """A Thunder engine (layered program) with every piece traced up front into its own compile cache."""
    engine = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(cache_dir)))
    engine.warmup()
    return engine


def thunder_traces(engine: Engine) -> list[tuple[str, str]]:
    """(final execution trace, prologue) as Python, of every function Thunder jitted, in order."""
    thunder = import_thunder()
    jitted = engine.runner.step_fn.jitted
    return [
        (
            TIMING.sub("", thunder.last_traces(j)[-1].python()),
            TIMING.sub("", thunder.last_prologue_traces(j)[-1].python()),
        )
        for j in jitted
    ]


def outputs(engine: Engine) -> list:
    """Greedy and sampled requests (both kinds of head); tokens and logprobs, bit for bit."""
    params = [SamplingParams(max_new_tokens=4, temperature=t, seed=3) for t in (0.0, 0.8, 0.0)]
    results = engine.generate(mixed_prompts(3, [1, 6, 3]), params)
    return [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in results]


@pytest.mark.regression
def test_layered_pieces_trace_the_same_with_and_without_the_shortcuts(shortcuts, tmp_path):
    runs = {}
    for on in (True, False):
        shortcuts(on)
        engine = traced_engine(tiny_gpt("llama"), tmp_path / f"shortcuts_{on}")
        assert bool(trace_speedups._installed) == on
        assert engine.stats()["programs"] == {
            "prefix": 3,
            "block": 3,
            "head-filtered": 3,
            "head-unsorted": 3,
            "head-greedy": 3,
        }
        runs[on] = thunder_traces(engine), outputs(engine)
    (fast, fast_outputs), (slow, slow_outputs) = runs[True], runs[False]
    assert len(fast) == 16  # at each shape: prefix, block (twice: layer 1 found the same program), 3 heads
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a[0] == b[0], f"execution trace {i} differs"
        assert a[1] == b[1], f"prologue {i} differs (guards or provenance)"
    assert fast_outputs == slow_outputs


@pytest.mark.regression
def test_module_hooks_still_run_under_the_shortcut(shortcuts, tmp_path):
    shortcuts(True)
    gpt = tiny_gpt("llama", n_layer=1)
    gpt.lm_head.register_forward_hook(lambda module, inputs, output: output * 0 + torch.arange(output.shape[-1]))
    results = traced_engine(gpt, tmp_path).generate([[7], [9]], SamplingParams(max_new_tokens=2))
    assert trace_speedups._installed
    assert [r.token_ids for r in results] == [[VOCAB - 1] * 2] * 2  # the hook's logits decided the tokens


def test_pinned_sources_match_this_install():
    """If Thunder or torch changes a function a shortcut stands in for, the shortcuts stay off
    (tracing is then slower, never different); this test names what changed."""
    import_thunder()
    assert trace_speedups.unverified_sources() == []
    assert trace_speedups.install()


def test_switching_off_is_logged_once_and_in_the_stats(shortcuts, monkeypatch, caplog):
    """A changed source (as on another torch) turns the shortcuts off with one warning naming it, and
    the engine's stats say they are off and why."""
    import_thunder()
    shortcuts(True)
    monkeypatch.setitem(trace_speedups._VERIFIED_SOURCES, "torch.nn.Module._call_impl", "0" * 16)
    with caplog.at_level("WARNING", logger=trace_speedups.__name__):
        assert not trace_speedups.install() and not trace_speedups.install()
    warnings = [r.getMessage() for r in caplog.records if r.name == trace_speedups.__name__]
    assert len(warnings) == 1 and "torch.nn.Module._call_impl" in warnings[0]
    want = "off: source differs from the verified one: torch.nn.Module._call_impl"
    assert trace_speedups.status() == want
    engine = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(**CONFIG, compile="thunder"))
    assert engine.stats()["trace_speedups"] == want
    monkeypatch.setenv("THUNDER_BATCH_FAST_TRACE", "0")
    assert not trace_speedups.install() and trace_speedups.status() == "off: THUNDER_BATCH_FAST_TRACE=0"
    monkeypatch.undo()
    assert trace_speedups.install() and trace_speedups.status() == "on"
