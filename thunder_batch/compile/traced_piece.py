"""One traced piece of the step program, and the rule by which modules share a trace.

`trace_piece` runs Thunder on one module (a prefix, one layer's block, a head) and keeps what it
needs to run the same computation against any module that passes the trace's prologue checks:
the computation function, which call argument or module tensor (by qualified name) feeds each
of its inputs, and the checks themselves (see `signature`). `SharedTraces` decides which modules
share a trace: exactly those Thunder's checks accept, except for values shown not to matter.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from thunder_batch._compat import import_thunder
from thunder_batch.compile import trace_checks
from thunder_batch.compile.trace_checks import Check, Path
from thunder_batch.compile.trace_export import (
    BoundComputation,
    NotExportable,
    computation_and_inputs,
    export_record,
    input_bindings,
    load_computation,
    single_output,
    written_in_trace,
    written_names,
)


@dataclass
class TracedPiece:
    """A piece's computation, runnable against any module that passes `checks`."""

    computation: Callable
    bindings: list  # per computation input: ["arg", i] or ["tensor", qualified name, metadata]
    written: list[str]  # module buffers it writes in place (the KV caches), by qualified name
    single: bool  # returns one value, not a tuple
    checks: list[Check]  # what Thunder's prologue checks on the module
    source: str  # the computation as Python: equal sources are the same program
    record: dict | None = None  # the storable form; None when not exportable
    not_stored: str | None = None  # why `record` is None
    jitted: object | None = field(default=None, repr=False)  # Thunder's module (None when loaded)
    checked: bool = False  # loaded, and it passed its load-time check (on the first layer it served)

    def bind(self, module: nn.Module) -> BoundComputation:
        return BoundComputation(self.computation, self.bindings, module, self.written, self.single)

    def execution_trace(self):
        """Thunder's final execution trace (only for a piece traced in this process)."""
        if self.jitted is None:
            return None
        return import_thunder().last_traces(self.jitted)[-1]


def trace_piece(module: nn.Module, args: Sequence[torch.Tensor], options: dict):
    """Trace `module` for `args` with Thunder (running it once); returns (TracedPiece, its outputs)."""
    thunder = import_thunder()
    jitted = thunder.jit(module, **options)
    outputs = jitted(*args)
    entry, inputs = computation_and_inputs(jitted, args)
    bindings = input_bindings(inputs, args, module)
    checks = trace_checks.prologue_checks(entry.prologue_traces[-1])
    piece = TracedPiece(
        entry.computation_fn,
        bindings,
        written_in_trace(entry, bindings),
        single_output(entry),
        checks,
        program_text(entry.computation_traces[-1]),
        jitted=jitted,
    )
    try:
        piece.record = dict(export_record(entry, bindings), checks=trace_checks.to_json(checks))
    except NotExportable as e:
        piece.not_stored = str(e)
    return piece, outputs


def program_text(trace) -> str:
    """The computation as Python, followed by the source of each fusion region it calls: a region's
    call alone does not say what it computes (two layers' blocks can call different regions by one name)."""
    from thunder_batch.compile.fused_region import FusedRegion

    calls = [v for b in trace.bound_symbols for v in (b._call_ctx or {}).values() if isinstance(v, FusedRegion)]
    return "\n".join([trace.python(), *(f"# {r.name}\n{r.source}" for r in calls)])


def piece_from_record(record: dict) -> TracedPiece:
    """A stored piece, ready to bind (raises if its code cannot be loaded)."""
    return TracedPiece(
        load_computation(record),
        record["inputs"],
        written_names(record),
        record["single_output"],
        trace_checks.from_json(record["checks"]),
        record["source"],
        record=record,
    )


def same_program_text(a: str, b: str) -> bool:
    """The same source up to a consistent renaming of Thunder's proxies (`t123`): tracing with the
    fusion executor takes proxy names from a process-wide counter, so two traces of one program
    differ in them."""
    return _canonical_names(a) == _canonical_names(b)


def _canonical_names(source: str) -> str:
    """The source without its comment lines (Thunder's say how long a pass took), proxies renamed."""
    source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    names: dict[str, str] = {}
    return re.sub(r"\bt\d+\b", lambda m: names.setdefault(m.group(0), f"t_{len(names)}"), source)


class SharedTraces:
    """The traces of one piece kind at one step shape, each shared by every module it accepts.

    Thunder checks every plain attribute of every module it touches, including bookkeeping that
    never reaches the computation (litgpt's `block_idx`). When a new trace turns out to be the
    same program as an earlier one, the values on which their checks differ are shown not to
    change the program: they are ignored from then on, so later layers reuse the trace.
    """

    def __init__(self, ignored: set[Path] | None = None) -> None:
        """ignored: the set of values found not to matter, shared (and grown) with other shapes."""
        self.traces: list[TracedPiece] = []
        self.ignored: set[Path] = set() if ignored is None else ignored

    def find(self, module: nn.Module) -> TracedPiece | None:
        """The first trace whose checks `module` passes, apart from ignored values."""
        for piece in self.traces:
            if trace_checks.mismatches(piece.checks, module) <= self.ignored:
                return piece
        return None

    def add(self, new: TracedPiece) -> TracedPiece:
        """Keep `new`, or the earlier trace that is the same program (learning what to ignore)."""
        for old in self.traces:
            differing = trace_checks.differing_paths(old.checks, new.checks)
            if differing is not None and same_program_text(old.source, new.source):
                self.ignored |= differing
                return old
        self.traces.append(new)
        return new

    def digest(self, piece: TracedPiece) -> str:
        return trace_checks.digest(piece.checks, self.ignored)
