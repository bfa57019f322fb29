"""CUDA graphs over the composed step (compile/cuda_graphs.py).

Without CUDA, a stand-in backend plays the graph: its capture records every tensor op the step runs
(a TorchDispatchMode), and its replay re-runs exactly those ops on the same tensors, writing each result
into the tensor the capture made. Like a CUDA graph it holds fixed memory and runs no Python at replay,
so a step replayed through it gives the right tokens only if the static inputs are refreshed before
every replay and nothing the step needs happens outside its tensor ops. The CUDA tests run the real
thing and skip with the reason elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.cuda_graphs import CUDAGraphProgram, graph_key
from thunder_batch.compile.step import execution_traces

from helpers import kv_buffers, mixed_prompts, needs_cuda, tiny_gpt

SHAPE = dict(batch_size=2, max_seq_length=32, prefill_chunk=4)  # two step shapes: decode only, 2 lanes of 4
LENGTHS = [1, 3, 6, 9, 2]  # 5 prompts through 2 slots: slots reused, prompts chunked and padded
# Greedy, sampled with a top-k above SMALL_TOP_K (the sort), sampled without it: three head variants.
PARAMS = [
    SamplingParams(max_new_tokens=5, temperature=t, top_k=k, seed=7) for t, k in ((0, None), (0.9, 100), (0.7, None))
]


class RecordedGraph:
    """A CPU stand-in for torch.cuda.CUDAGraph: `ops` recorded at capture, re-run by `replay()`."""

    def __init__(self) -> None:
        self.ops: list = []
        self.replays = 0

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            result = func(*args, **kwargs)
            for captured, new in zip(tree_leaves(out), tree_leaves(result)):
                if isinstance(captured, torch.Tensor) and captured.data_ptr() != new.data_ptr():
                    captured.copy_(new)  # into the memory the capture gave it (views and in-place ops are there)
        self.replays += 1


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(o, (bool, int, float)) for o in tree_leaves(out)):
            raise RuntimeError(f"{func} returned a host value inside a captured step (a host sync on CUDA)")
        self.graph.ops.append((func, args, kwargs, out))
        return out


class RecordingBackend:
    """CUDAGraphs' interface on CPU: a warm-up run, then a recorded capture run."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []

    def capture(self, run):
        run()
        graph = RecordedGraph()
        with _Recorder(graph):
            outputs = run()
        self.graphs.append(graph)
        return graph, outputs


class Spy:
    """The wrapped program, noting (rows N, entries read L, head) of every call that reaches it."""

    def __init__(self, program) -> None:
        self.program, self.calls = program, []

    def __call__(self, *args, head: str):
        self.calls.append((int(args[0].shape[0]), int(args[3].shape[0]), head))
        return self.program(*args, head=head)


def run(engine: Engine, prompts) -> list:
    results = engine.generate(prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))])
    return [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in results]


def with_recorded_graphs(engine: Engine, spy: Spy | None = None) -> tuple[CUDAGraphProgram, RecordingBackend]:
    """Put the engine's step program (or `spy` on it) under recorded graphs, as cuda_graphs=True does
    with real ones."""
    backend = RecordingBackend()
    engine.runner.step_fn = CUDAGraphProgram(spy or engine.runner.step_fn, backend)
    return engine.runner.step_fn, backend


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(len(LENGTHS), LENGTHS, seed=3)


# -- the stand-in itself ----------------------------------------------------------------------------
def test_recorded_graph_replays_ops_not_python():
    x, calls = torch.zeros(3), []

    def step():
        calls.append(1)
        return (x * 2 + 1).sum(), x.index_copy_(0, torch.tensor([1]), torch.tensor([5.0]))

    graph, (total, _) = RecordingBackend().capture(step)
    x.copy_(torch.tensor([1.0, 0.0, 3.0]))
    graph.replay()
    assert len(calls) == 2 and total.item() == 11.0 and x.tolist() == [1.0, 5.0, 3.0]


# -- the wrapper, on the eager step program -----------------------------------------------------------
def test_one_graph_per_shape_and_head_made_after_an_ordinary_call(prompts):
    engine = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(compile="eager", **SHAPE))
    spy = Spy(engine.runner.step_fn)
    graphs, backend = with_recorded_graphs(engine, spy)
    reference = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(compile="eager", **SHAPE))
    assert run(engine, prompts) == run(reference, prompts)  # bit for bit, logprobs too
    keys = list(dict.fromkeys(spy.calls))
    assert len({(n, length) for n, length, _ in keys}) == 3 and {h for *_, h in keys} >= {"greedy", "filtered"}
    # Each key: one ordinary call, the warm-up and the capture, in a row; after that only replays.
    assert spy.calls == [key for key in keys for _ in range(3)]
    assert len(graphs.graphs) == len(backend.graphs) == len(keys)
    assert graphs.replays == graphs.calls - len(keys) > 5
    assert sum(g.replays for g in backend.graphs) == graphs.replays


def test_replays_read_fresh_inputs_and_hand_out_copies():
    state = torch.zeros(4)

    def program(x, pos, target=None, head="filtered"):  # a step: writes its state, reads it back
        state.index_copy_(0, pos, x)
        return state * 10, x.sum().reshape(1)

    graphs = CUDAGraphProgram(program, RecordingBackend())
    first = graphs(torch.tensor([1.0, 2.0]), torch.tensor([0, 1]), None)
    second = graphs(torch.tensor([3.0, 4.0]), torch.tensor([2, 3]), None)  # a replay
    assert graphs.replays == 1 and graph_key((torch.zeros(2), torch.zeros(2, dtype=torch.long), None), "filtered") in (
        graphs.graphs
    )
    assert second[0].tolist() == [10.0, 20.0, 30.0, 40.0] and second[1].tolist() == [7.0]
    (captured,) = graphs.graphs.values()
    assert all(out.data_ptr() != static.data_ptr() for out, static in zip(second, captured.outputs))
    third = graphs(torch.tensor([5.0, 6.0]), torch.tensor([0, 1]), None)
    assert third[0].tolist() == [50.0, 60.0, 30.0, 40.0]
    assert second[0].tolist() == [10.0, 20.0, 30.0, 40.0] and first[1].tolist() == [3.0]  # not overwritten
    assert captured.inputs[2] is None
    graphs(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 1, 2]), None)  # another shape: its own graph
    assert len(graphs.graphs) == 2


class FailingBackend:
    """A capture that fails (as a CUDA graph capture can: an op that syncs, a driver error)."""

    def capture(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_leaves_that_shape_uncaptured_and_its_output_kept(prompts, monkeypatch):
    from thunder_batch import fallbacks

    monkeypatch.setattr(fallbacks, "_counts", fallbacks.Counter())
    monkeypatch.setattr(fallbacks, "_warned", set())
    engine = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(compile="eager", **SHAPE))
    spy = Spy(engine.runner.step_fn)
    engine.runner.step_fn = graphs = CUDAGraphProgram(spy, FailingBackend())
    reference = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(compile="eager", **SHAPE))
    with pytest.warns(fallbacks.FallbackWarning, match="could not be captured in a CUDA graph") as caught:
        assert run(engine, prompts) == run(reference, prompts)  # every step's output kept, bit for bit
    assert len(caught) == 1  # reported once
    keys = set(spy.calls)
    assert len(spy.calls) == graphs.calls and len(graphs.uncaptured) == len(keys) and not graphs.graphs
    assert fallbacks.counts()["cuda_graph_capture"] == len(keys)  # one failed capture per key, never retried


def test_cuda_graphs_work_with_either_trace_but_need_cuda():
    for trace in ("layers", "step"):
        EngineConfig(cuda_graphs=True, trace=trace)
    with pytest.raises(ValueError, match="needs the model on a CUDA device; it is on cpu"):
        Engine(tiny_gpt("llama", n_layer=1), EngineConfig(cuda_graphs=True, **SHAPE))


# -- the layered program ---------------------------------------------------------------------------
def test_layered_program_under_recorded_graphs_matches_it_uncaptured(prompts, tmp_path):
    """Thunder's pieces, traced at the first call of each shape, then captured with every layer: the
    same tokens and logprobs as the layered program alone, bit for bit."""
    config = EngineConfig(**SHAPE, cache_dir=str(tmp_path))
    plain = Engine(tiny_gpt("llama", n_layer=1), config)
    want = run(plain, prompts)
    engine = Engine(tiny_gpt("llama", n_layer=1), config)  # its pieces come from the compile cache
    graphs, backend = with_recorded_graphs(engine)
    assert run(engine, prompts) == want
    stats = engine.stats()
    assert stats["cuda_graphs"] == dict(captured=len(backend.graphs), replays=graphs.replays, uncaptured=0)
    assert graphs.replays > 5 and stats["cache_misses"] == 3 and stats["cache_hits"] == graphs.calls - 3
    assert stats["disk_cache_hits"] > 0 and stats["traced"] == 0


# -- CUDA --------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.cuda
@pytest.mark.regression
@pytest.mark.parametrize(
    "trace,executors", [("layers", None), ("step", None), ("step", ("torchcompile", "torch"))], ids=str
)
def test_cuda_graphs_match_eager_with_the_cache_written_in_place(trace, executors, prompts, tmp_path):
    """CUDA graphs wrap the composed step from outside (no CUDAGraph region in Thunder's traces)."""
    config = EngineConfig(**SHAPE, cuda_graphs=True, trace=trace, executors=executors, cache_dir=str(tmp_path))
    engine = Engine(tiny_gpt("llama", n_layer=2).cuda(), config)
    pointers = [b.data_ptr() for b in kv_buffers(engine)]
    eager = Engine(tiny_gpt("llama", n_layer=2).cuda(), EngineConfig(compile="eager", **SHAPE))
    got, want = run(engine, prompts), run(eager, prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    graphs = engine.stats()["cuda_graphs"]
    assert graphs["captured"] >= 2 and graphs["replays"] > 20, graphs
    assert execution_traces(engine.runner.step_fn)  # the pieces the graphs captured were traced here
    assert [b.data_ptr() for b in kv_buffers(engine)] == pointers  # written in place: same storage
    S = SHAPE["max_seq_length"]
    for mine, theirs in zip(kv_buffers(engine), kv_buffers(eager)):
        torch.testing.assert_close(mine[..., :S, :], theirs[..., :S, :])
