"""CUDA graphs over the step program: the whole composed step of one shape (prefix, every layer's block,
head) captured once in one `torch.cuda.CUDAGraph` and replayed at every later step of that shape.

A decode step of a 30-layer model is hundreds of small kernels; launched from Python one by one, the
host is the bottleneck at small batches. A replay launches them all at once.

One graph per (input shapes, head variant), made at the first call of that key once the call has run as
usual (which makes the pieces: traced, or loaded from the compile cache), so a graph captures the very
pieces the uncaptured program runs. The capture is prepared as PyTorch
prescribes: the inputs are copied into static buffers, the program runs once on the capture stream
(lazy initialisation, cuBLAS workspaces), then is captured there. Later calls copy their inputs into
the static buffers, replay, and return copies of the static outputs.

Why this is sound here:
- The program's only state is the slot KV caches (and fixed weights), written in place: the graph
  writes the same buffers as the uncaptured program. Running a step again on the same inputs writes
  the same entries with the same values (each row writes its own entry from values that depend only on
  the entries up to it), so the warm-up run leaves the caches as the first run left them.
- No step syncs with the host or branches on tensor values (docs/DESIGN.md, invariant 8): a replay does
  everything the step does.
- All graphs share one memory pool, so one graph's replay may overwrite another graph's static outputs:
  each replay's outputs are copied out at once and the static ones are never handed out.

`backend` does the CUDA work (`CUDAGraphs`); tests pass a stand-in that records and replays on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from thunder_batch import fallbacks


class CUDAGraphs:
    """Capture on one device: a side stream and a memory pool shared by every graph of the program."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], object]) -> tuple[object, object]:
        """(a replayable graph of `run`, the outputs it writes on every replay)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the static inputs were filled on the current stream
        with torch.cuda.stream(self.stream):
            run()  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            outputs = run()
        current.wait_stream(self.stream)
        return graph, outputs


@dataclass
class _Captured:
    graph: object  # has replay()
    inputs: tuple  # static input buffers (None where the call passed None)
    outputs: object  # static outputs: a tensor or a tuple of them, rewritten by every replay


def graph_key(args: tuple, head: str) -> tuple:
    """What a graph is specific to: the head variant and every input's shape and dtype."""
    return head, tuple(None if a is None else (tuple(a.shape), a.dtype) for a in args)


class CUDAGraphProgram:
    """Called like the step program it wraps (`program`: the layered program, or the whole-step trace)."""

    def __init__(self, program: Callable, backend) -> None:
        self.program, self.backend = program, backend
        self.graphs: dict[tuple, _Captured] = {}
        self.uncaptured: set[tuple] = set()  # keys whose capture failed: they run as the program
        self.calls = 0
        self.replays = 0

    @torch.no_grad()
    def __call__(self, *args, head: str | tuple[str, ...] = "filtered"):
        if isinstance(head, tuple):  # a warm-up of several heads: one graph each, so one whole step each
            return tuple(self(*args, head=h) for h in head)
        self.calls += 1
        key = graph_key(args, head)
        captured = self.graphs.get(key)
        if captured is None:
            out = self.program(*args, head=head)  # makes the pieces of this shape and head
            if key not in self.uncaptured:
                self._try_capture(key, args, head)
            return out
        for static, arg in zip(captured.inputs, args):
            if static is not None:
                static.copy_(arg)
        captured.graph.replay()
        self.replays += 1
        return _copied(captured.outputs)

    def _try_capture(self, key: tuple, args: tuple, head: str) -> None:
        """Capture `key`'s graph; if that fails, the key runs uncaptured from now on (reported)."""
        try:
            self.graphs[key] = self._capture(args, head)
        except Exception as e:
            self.uncaptured.add(key)
            message = f"a step shape could not be captured in a CUDA graph ({type(e).__name__}: {e})"
            fallbacks.report("cuda_graph_capture", message + ": it runs uncaptured")

    def _capture(self, args: tuple, head: str) -> _Captured:
        inputs = tuple(None if a is None else a.clone() for a in args)
        graph, outputs = self.backend.capture(lambda: self.program(*inputs, head=head))
        return _Captured(graph, inputs, outputs)

    def add_stats(self, stats: dict) -> dict:
        """The wrapped program's counters, with this program's calls and its graphs."""
        return dict(
            stats,
            cache_hits=max(self.calls - stats["cache_misses"], 0),
            cuda_graphs=dict(captured=len(self.graphs), replays=self.replays, uncaptured=len(self.uncaptured)),
        )


def _copied(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return type(outputs)(_copied(o) for o in outputs)
