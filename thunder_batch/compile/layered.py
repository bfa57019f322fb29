"""The compiled step: per step shape (rows N, cache entries read L), a prefix and a block program per
layer, and per N a head per variant used (sampler, and top or prompt logprobs), each traced once by Thunder
or loaded from the compile cache.

Layers share a block trace whenever Thunder's prologue checks would accept them (see `pieces`), so
a cold compile traces two or three blocks, not the model's depth. A stored piece is checked on
first use against the eager module on the same inputs (outputs and in-place cache writes) and
retraced, with one warning, if it disagrees. Where a decode-only shape's every layer program is the one
native block op, the layers then run as one native loop of those op calls (block_op.BlockStack).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from thunder_batch import fallbacks
from thunder_batch._compat import import_thunder
from thunder_batch.compile.block_op import BlockStack, OpCalls
from thunder_batch.compile.cache import CompileCacheFiles, warn
from thunder_batch.compile.fused_region import artifacts_in, has_regions
from thunder_batch.compile.fusion import EXECUTOR as FUSION
from thunder_batch.compile.load_check import checked_call
from thunder_batch.compile.piece_store import PieceKeys
from thunder_batch.compile.project_executor import EXECUTOR, PACKED, ProjectKernelsMode
from thunder_batch.compile.traced_piece import SharedTraces, TracedPiece, trace_piece
from thunder_batch.program import StepInputs, StepProgram


@dataclass
class _Probe:
    """Each piece's inputs in a step of one shape whose every row is real (the load-time check's)."""

    prefix: tuple
    block: tuple
    head: tuple


class _Shape:
    """The programs of one step shape (rows N, cache entries read L); heads are per N, shared."""

    def __init__(self, rows: int, length: int, ignored: set, heads: dict[str, Callable]) -> None:
        self.rows, self.length = rows, length
        self.probe: _Probe | None = None  # made when a stored piece of this shape is first checked
        self.prefix: Callable | None = None
        self.blocks: dict[int, Callable] = {}
        self.heads = heads
        self.shared = SharedTraces(ignored)
        self.blocks_settled = False  # every layer has its program (and they are stored)
        self.stack: BlockStack | None = None  # the layers as one native call (block_op)
        self.may_stack = False  # decode-only, every layer marked for the one op: until a step shows otherwise


class LayeredProgram:
    """Called like the step program; makes each piece's program on first use at each shape.

    options: thunder.jit keyword arguments (heads leave the fusion out: `head_options`); store: the
    compile cache, or None to keep programs in memory only; probe_inputs(rows, length): the step's
    arguments with every row real (the runner's), on which a stored piece is checked against eager
    before it runs (None: on the first call's own arguments)."""

    def __init__(
        self,
        program: StepProgram,
        config,
        options: dict,
        store: CompileCacheFiles | None,
        probe_inputs: Callable[[int, int], StepInputs] | None = None,
    ) -> None:
        self.program, self.config, self.options, self.store = program, config, options, store
        self.probe_inputs = probe_inputs
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._heads: dict[int, dict[str, Callable]] = {}  # rows N -> head programs
        # Checked values two identical block traces showed not to matter (litgpt's block_idx): a
        # property of the block's code, learned at the first shape and used at every shape.
        self.ignored: set = set()
        self.traced: Counter = Counter()  # piece kind -> programs traced in this process
        self.loaded: Counter = Counter()  # piece kind -> programs loaded from the compile cache
        self.pieces: list[TracedPiece] = []  # every distinct program made, in order
        self.jitted: list = []  # every function Thunder jitted here, duplicate block traces included
        self.calls = 0
        # False during a warm-up (`compile.step.outputs_unused`): its outputs are thrown away, so a layer
        # whose program an earlier layer ran is bound without running (at B=64 those runs were about half
        # of a warm start: benchmarks/RESULTS.md, "The server's own cost per step, and a warm start at B=64").
        self.outputs_used = True
        self.seconds: Counter = Counter()  # piece kind -> seconds making its programs (first calls included)
        names = [getattr(ex, "name", None) for ex in options.get("executors", ())]
        self._eager_linears = ProjectKernelsMode if EXECUTOR in names else contextlib.nullcontext
        # Heads are not fused: a few ops a step, and fused logits could move a near-tie's argmax.
        executors = [ex for ex in options.get("executors", ()) if ex.name != FUSION]
        self.head_options = dict(options, executors=executors) if FUSION in names else options
        self.cache = None if store is None else PieceKeys(store, program, config, options, self.head_options)

    def _making(self):
        """The context pieces are made in: fusion regions store their compiled code under the cache root."""
        return artifacts_in(self.store.root if self.store is not None and self.store.writable else None)

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor, head: str | tuple[str, ...] = "filtered"):
        """inputs: the StepInputs' tensors in their order; head: as StepProgram.forward's."""
        self.calls += 1
        step = StepInputs(*inputs)
        rows, length = int(step.idx.shape[0]), int(step.key_pos.shape[0])
        shape = self._shapes.get((rows, length))
        if shape is None:
            shape = self._shapes[rows, length] = _Shape(rows, length, self.ignored, self._heads.setdefault(rows, {}))
            shape.may_stack = self._may_stack(rows)
        x, *shared = self._prefix(shape, step.prefix_args())
        x = self._blocks(shape, x, shared)
        if isinstance(head, tuple):  # a warm-up: every head on one run of the layers
            return tuple(self._head(shape, h, step.head_args(x)) for h in head)
        return self._head(shape, head, step.head_args(x))

    # -- pieces -------------------------------------------------------------------------------
    def _head(self, shape: _Shape, head: str, args: tuple):
        kind = f"head-{head}"
        fn = shape.heads.get(kind)
        if fn is None:
            # A controlled head's controls (StepInputs.bias ...) are past the probe's arguments: the call's own.
            probe = lambda: (*(head_args := self._probe(shape, args).head), *args[len(head_args) :])  # noqa: E731
            fn, out = self._make(kind, self.program.heads[head], args, probe)
            shape.heads[kind] = fn
            return out
        return fn(*args)

    def _prefix(self, shape: _Shape, args: tuple):
        if shape.prefix is None:
            probe = lambda: self._probe(shape, args).prefix  # noqa: E731
            shape.prefix, out = self._make("prefix", self.program.prefix, args, probe)
            return out
        return shape.prefix(*args)

    def _probe(self, shape: _Shape, args: tuple) -> _Probe:
        """The shape's probe (every row real: lanes read what they wrote, decode rows their history); without
        `probe_inputs`, the call's own `args` serve every piece they fit."""
        if shape.probe is None:
            if self.probe_inputs is None:
                return _Probe(args, args, args)
            step = self.probe_inputs(shape.rows, shape.length)
            with self._eager_linears():
                x, *shared = self.program.prefix(*step.prefix_args())
            shape.probe = _Probe(step.prefix_args(), (x, *shared), step.head_args(x))
        return shape.probe

    def _blocks(self, shape: _Shape, x: torch.Tensor, shared: list) -> torch.Tensor:
        """The layers, each its program; once they are settled and each is the one native block op (block_op),
        the same op calls from one native loop (BlockStack) without a Python frame per layer."""
        if shape.stack is not None:
            out = shape.stack(x, shared)
            if out is not None:
                return out
            shape.stack = None  # a weight changed in place: its layer's program packs it again
        record, x_in = shape.blocks_settled and shape.may_stack, x
        with OpCalls() if record else contextlib.nullcontext() as calls:
            for i in range(len(self.program.blocks)):
                x = self._block(shape, i, (x, *shared))
        if record:
            shape.stack = self._checked_stack(calls, x_in, shared, x)
            shape.may_stack = shape.stack is not None
        if not shape.blocks_settled:
            shape.blocks_settled = True
            if self.cache is not None:
                self.cache.save_blocks(shape.shared, (x, *shared))
        return x

    def _checked_stack(self, calls: OpCalls, x_in, shared: list, out: torch.Tensor) -> BlockStack | None:
        """The native loop of one step's recorded op calls, if it gives that step's output again, bit for bit
        (the same calls; running a step's layers again writes the same cache entries): its load-time check."""
        stack = BlockStack.of(calls, len(self.program.blocks), x_in, shared, PACKED.sources())
        if stack is None:
            return None
        again = stack(x_in, shared)
        if again is not None and torch.equal(again, out):
            return stack
        message = "a step shape's layers as one native loop did not give its programs' output: the programs run"
        fallbacks.report("native_loop", message)
        return None

    def _may_stack(self, rows: int) -> bool:
        """Whether steps of `rows` rows are decode-only and every layer is marked to run them as the one op."""
        blocks = self.program.blocks
        return rows == blocks[0].cache.k.shape[0] and all(block.one_call for block in blocks)

    def _block(self, shape: _Shape, i: int, args: tuple):
        fn = shape.blocks.get(i)
        if fn is not None:
            return fn(*args)
        module = self.program.blocks[i]
        start = time.perf_counter()
        with self._making():
            return self._load_or_trace_block(shape, i, module, args, start)

    def _load_or_trace_block(self, shape: _Shape, i: int, module, args: tuple, start: float):
        try:
            if not shape.shared.traces and self.cache is not None:
                self._take_stored_blocks(shape, args)
            piece = shape.shared.find(module)
            if piece is not None:
                probe = lambda: self._probe(shape, args).block  # noqa: E731  (made only to check a stored piece)
                bound, out = self._first_call(shape, piece, module, args, probe)
                if bound is not None:
                    shape.blocks[i] = bound
                    return out
            piece, out = trace_piece(module, args, self.options)
            kept = shape.shared.add(piece)
            self._count(kept is piece, "block", piece, traced=True)
            shape.blocks[i] = kept.bind(module)
            return out
        finally:
            self.seconds["block"] += time.perf_counter() - start

    def _first_call(self, shape: _Shape, piece: TracedPiece, module, args, probe: Callable[[], tuple]):
        """(the piece bound to a new layer, its outputs); a stored piece is checked against the eager
        module on the `probe()` inputs before its first use, and one that fails is dropped: (None, None).
        Once is enough: the layers it serves next pass the same prologue checks and run the same program
        (checking all 30 layers was most of a warm start at B=64: benchmarks/RESULTS.md, "The server's own
        cost per step, and a warm start at B=64"). In a warm-up those later layers are bound, not run: their
        input stands for their output, and their weights are packed as the layer that ran the program packed
        its own (else a server's first decode step packed 29 layers: RESULTS.md, "A warm-up that packs every
        layer")."""
        bound = piece.bind(module)
        if piece.jitted is not None or piece.checked:  # an earlier layer ran this program (traced, or checked)
            if self.outputs_used:
                return bound, bound(*args)
            ran = next(b for b in shape.blocks.values() if b.computation is bound.computation)
            PACKED.pack_as(ran.bindings, bound.bindings)
            return bound, args[0]  # x [N, C] -> x [N, C]
        problem = checked_call(bound, module, probe(), self._eager_linears)
        if problem:
            warn(f"compile cache block entry ignored, retracing: failed its load-time check ({problem})")
            shape.shared.traces.remove(piece)
            self.pieces.remove(piece)
            self.loaded["block"] -= 1
            return None, None
        piece.checked = True
        return bound, bound(*args)  # its first run, warm-up or not: it loads the piece's compiled regions

    def _make(self, kind: str, module, args: tuple, probe: Callable[[], tuple]):
        """A prefix or head program: loaded if stored and sound on the `probe()` inputs, else traced (and stored)."""
        start = time.perf_counter()
        with self._making():
            return self._load_or_trace(kind, module, args, probe, start)

    def _load_or_trace(self, kind: str, module, args: tuple, probe: Callable[[], tuple], start: float):
        try:
            key = self.cache.key(kind, "", args) if self.cache is not None else None
            piece = self.cache.load(key) if key is not None else None
            if piece is not None:
                bound = piece.bind(module)
                problem = checked_call(bound, module, probe(), self._eager_linears)
                if not problem:
                    self._count(True, kind, piece, traced=False)
                    return bound, None if self._checked_is_enough(kind, piece) else bound(*args)
                warn(
                    f"compile cache entry {self.cache.name(key)} ignored, retracing: "
                    f"failed its load-time check ({problem})"
                )
            options = self.head_options if kind.startswith("head") else self.options
            piece, out = trace_piece(module, args, options)
            self._count(True, kind, piece, traced=True)
            if key is not None:
                self.cache.save(key, piece)
            return piece.bind(module), out
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def _checked_is_enough(self, kind: str, piece: TracedPiece) -> bool:
        """A warm-up need not run a head its check just ran: nothing reads its output, and it has no
        compiled regions to load (at B = 64 a head's run, the logits and the sampler's sort, is a large part
        of a warm-up: benchmarks/RESULTS.md, "A warm-up that checks a stored head without running it again")."""
        return not self.outputs_used and kind.startswith("head") and not has_regions(piece.computation)

    def _count(self, new: bool, kind: str, piece: TracedPiece, traced: bool) -> None:
        if traced:
            self.jitted.append(piece.jitted)
        if new:
            (self.traced if traced else self.loaded)[kind] += 1
            self.pieces.append(piece)
        elif traced:
            self.traced[kind + " (same as an earlier layer)"] += 1

    def rebind(self) -> None:
        """Every program made so far takes its module's tensors afresh (some weight is a new tensor), and the
        native loops, which hold packed copies of the old ones, are recorded again from the next steps."""
        for shape in self._shapes.values():
            for bound in (shape.prefix, *shape.blocks.values()):
                if bound is not None:
                    bound.rebind()
            shape.stack = None
        for heads in self._heads.values():
            for bound in heads.values():
                bound.rebind()

    # -- the compile cache --------------------------------------------------------------------
    def _take_stored_blocks(self, shape: _Shape, args: tuple) -> None:
        """The stored block programs of this shape, if its whole layout loads, and the values found not to matter."""
        stored = self.cache.load_blocks(args)
        if stored is None:
            return
        ignored, pieces = stored
        shape.shared.ignored |= ignored
        for piece in pieces:
            shape.shared.traces.append(piece)
            self._count(True, "block", piece, traced=False)

    # -- inspection ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """cache_misses counts step shapes made: one per (rows, attention length), whatever the traffic;
        thunder_traces the traces Thunder itself made (its cache_misses of every function jitted here)."""
        thunder = import_thunder()
        programs = Counter()
        for counter in (self.traced, self.loaded):
            for kind, n in counter.items():
                if "(" not in kind:
                    programs[kind] += n
        return dict(
            cache_misses=len(self._shapes),
            cache_hits=max(self.calls - len(self._shapes), 0),
            programs=dict(programs),
            traced=sum(self.traced.values()),
            thunder_traces=sum(thunder.cache_misses(jitted) for jitted in self.jitted),
            not_stored=sum(piece.record is None for piece in self.pieces if piece.jitted is not None),
            disk_cache_hits=sum(self.loaded.values()),
            compile_seconds=sum(self.seconds.values()),
            compile_seconds_by_piece={kind: round(s, 3) for kind, s in self.seconds.items()},
            stacked_shapes=sum(shape.stack is not None for shape in self._shapes.values()),
        )

    def execution_traces(self) -> list:
        """Thunder's final execution traces of every piece traced in this process."""
        return [t for t in (piece.execution_trace() for piece in self.pieces) if t is not None]
