"""compile.inplace: under the torch executor each KV cache write is one in-place index_copy_ (or
scatter_), not a write into a copy + copy back; caches, tokens and compiled outputs stay equal to eager."""

from __future__ import annotations

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch._compat import import_thunder
from thunder_batch.compile.inplace import INDEX_COPY_OPERATOR, OPERATOR
from thunder_batch.compile.step import compile_options, execution_traces

from helpers import ENGINE_CONFIG, mixed_prompts, tiny_gpt


def ops(trace) -> list[tuple[str, str | None]]:
    return [(b.sym.name, getattr(b.sym.executor, "name", None)) for b in trace.bound_symbols]


def run_mixed(engine: Engine) -> list[list[int]]:
    prompts = mixed_prompts(6, [1, 5, 13, 20], seed=3)
    params = [SamplingParams(max_new_tokens=5, temperature=[0.0, 0.9][i % 2], top_p=0.8, seed=i) for i in range(6)]
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.mark.regression
def test_cache_writes_run_in_place_and_match_eager():
    config = dict(ENGINE_CONFIG, executors=("sdpa", "torch"))
    eager = Engine(tiny_gpt("llama"), EngineConfig(compile="eager", **ENGINE_CONFIG))
    traced = Engine(tiny_gpt("llama"), EngineConfig(compile="thunder", **config))
    assert run_mixed(traced) == run_mixed(eager)
    for a, b in zip(traced.runner.caches, eager.runner.caches):
        torch.testing.assert_close(a.k, b.k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.v, b.v, rtol=1e-5, atol=1e-6)
    per_trace = [ops(trace) for trace in execution_traces(traced.runner.step_fn)]
    writes = [names.count((INDEX_COPY_OPERATOR, "thunder_batch")) for names in per_trace]
    assert sorted(set(writes)) == [0, 2], writes  # each block program: K and V in place; prefix and heads: none
    assert not any(("index_copy", "torch") in names for names in per_trace)
    assert traced.stats()["cache_misses"] == 3  # decode only, 1 and 2 lanes


def test_out_of_place_scatter_is_left_alone():
    """Only a scatter written back onto its own input may become in place: a plain `torch.scatter`
    must keep its input unchanged."""
    thunder = import_thunder()

    def f(t, idx, val):
        return torch.scatter(t, 1, idx, val), t * 2

    options = compile_options(EngineConfig(executors=("torch",)))
    jitted = thunder.jit(f, **options)
    t, idx, val = torch.zeros(2, 4), torch.tensor([[1], [3]]), torch.ones(2, 1)
    scattered, doubled = jitted(t, idx, val)
    assert torch.equal(t, torch.zeros(2, 4)) and torch.equal(doubled, torch.zeros(2, 4))
    assert scattered.sum().item() == 2.0
    names = ops(thunder.last_traces(jitted)[-1])
    assert ("scatter", "torch") in names and (OPERATOR, "thunder_batch") not in names


def test_in_place_scatter_of_an_input_matches_eager():
    thunder = import_thunder()

    def f(t, idx, val):
        before = t.sum()
        t.scatter_(1, idx, val)
        return t + before

    jitted = thunder.jit(f, **compile_options(EngineConfig(executors=("torch",))))
    t, idx, val = torch.arange(8.0).view(2, 4), torch.tensor([[1], [3]]), torch.full((2, 1), -1.0)
    expected_t = t.clone()
    expected = f(expected_t, idx, val)
    assert torch.equal(jitted(t, idx, val), expected) and torch.equal(t, expected_t)
    assert (OPERATOR, "thunder_batch") in ops(thunder.last_traces(jitted)[-1])


def test_in_place_index_copy_through_a_view_matches_eager():
    """The KV cache write's shape: index_copy_ into a flat view of a tensor the program is given."""
    thunder = import_thunder()

    def f(t, rows, val):
        t.view(-1, 2).index_copy_(0, rows, val)
        return t * 2

    jitted = thunder.jit(f, **compile_options(EngineConfig(executors=("torch",))))
    t, rows, val = torch.arange(8.0).view(2, 4), torch.tensor([3, 0]), torch.full((2, 2), -1.0)
    expected_t = t.clone()
    expected = f(expected_t, rows, val)
    assert torch.equal(jitted(t, rows, val), expected) and torch.equal(t, expected_t)
    names = ops(thunder.last_traces(jitted)[-1])
    assert (INDEX_COPY_OPERATOR, "thunder_batch") in names and ("index_copy", "torch") not in names
