"""The tracing shortcuts change how long Thunder takes, never what it produces."""

from __future__ import annotations

import copy

import pytest
import torch

from thunder_batch._compat import import_thunder
from thunder_batch.compile import trace_speedups
from thunder_batch.compile.step import compile_options, compile_program
from thunder_batch.config import EngineConfig
from thunder_batch.runner import Runner
from thunder_batch.scheduler import StepPlan

from helpers import tiny_gpt

CONFIG = EngineConfig(batch_size=2, max_seq_length=16, prefill_chunk=1)


def trace_step(gpt, fast: bool):
    """(outputs of one real step, computation trace, prologue source without its timing line)."""
    thunder = import_thunder()
    runner = Runner(gpt, EngineConfig(batch_size=2, max_seq_length=16, prefill_chunk=1, compile="eager"))
    args = runner.inputs_for(StepPlan([])).as_args()
    args[0][:], args[1][:] = torch.tensor([7, 9]), torch.tensor([0, 2])  # two decode rows, real tokens
    trace_speedups.uninstall()
    try:
        if fast:
            jitted = compile_program(runner.program, CONFIG)
        else:
            jitted = thunder.jit(runner.program, **compile_options(CONFIG))
        assert trace_speedups._installed if fast else not trace_speedups._installed
        with torch.no_grad():
            out = jitted(*args)
    finally:
        trace_speedups.install()
    prologue = thunder.last_prologue_traces(jitted)[-1].python().split("\n", 1)[1]
    return out, thunder.last_traces(jitted)[-1], prologue


def ops(trace) -> list[str]:
    # Thunder orders the operands of update_aliases by a set: the op sequence is what is stable.
    return [b.sym.name for b in trace.bound_symbols]


@pytest.mark.regression
def test_same_trace_and_outputs_with_and_without_speedups():
    gpt = tiny_gpt("llama", n_layer=1)
    fast_out, fast_trace, fast_prologue = trace_step(copy.deepcopy(gpt), fast=True)
    slow_out, slow_trace, slow_prologue = trace_step(copy.deepcopy(gpt), fast=False)
    assert all(torch.equal(a, b) for a, b in zip(fast_out, slow_out))
    assert ops(fast_trace) == ops(slow_trace)
    assert fast_prologue == slow_prologue  # same guards on the same inputs (provenance intact)


@pytest.mark.regression
def test_module_hooks_still_run_under_the_shortcut():
    gpt = tiny_gpt("llama", n_layer=1)
    gpt.lm_head.register_forward_hook(lambda module, inputs, output: output * 0 + torch.arange(output.shape[-1]))
    out, _, _ = trace_step(gpt, fast=True)
    assert out[0].tolist() == [gpt.config.padded_vocab_size - 1] * 2  # the hook's logits decided the token


def test_pinned_sources_match_this_install():
    """If Thunder or torch changes a function a shortcut stands in for, the shortcuts stay off
    (tracing is then slower, never different); this test names what changed."""
    import_thunder()
    assert trace_speedups.unverified_sources() == []
    assert trace_speedups.install()
