"""The step program to call: eager as it is, or compiled by Thunder (the layered program, or the
whole step as one trace), with the jit options the config implies; its counters and traces."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from torch import nn

from thunder_batch import fallbacks
from thunder_batch._compat import import_thunder
from thunder_batch.compile import executors as executor_lists
from thunder_batch.compile.executors import resolve_executors
from thunder_batch.config import EngineConfig
from thunder_batch.program import StepProgram


def compile_options(config: EngineConfig) -> dict:
    """Keyword arguments for thunder.jit implied by the config."""
    options: dict = {}
    if config.executors is None:
        options["executors"] = executor_lists.default_executors()  # looked up here: tests may pin it
    else:
        options["executors"] = resolve_executors(config.executors)
    if any(getattr(ex, "name", ex) == "nvfuser" for ex in options["executors"]):  # named, or among the defaults
        options["nv_enable_scatter"] = True  # lets nvFuser claim the KV cache scatter and the gathers
    from thunder_batch.compile.inplace import make_transform

    options["transforms"] = [make_transform()]  # KV cache writes in place, not two whole-cache copies
    return options  # cuda_graphs changes no piece: the composed step is captured around them (cuda_graphs)


def check_compile_setup(program: nn.Module, config: EngineConfig) -> None:
    """Reject, before anything is traced, executor and CUDA graph settings that cannot work here."""
    if config.compile == "eager":
        if config.cuda_graphs or config.executors is not None:
            raise ValueError("executors and cuda_graphs need compile='thunder' (got compile='eager')")
        return
    if config.executors is not None:
        resolve_executors(config.executors)
    if config.cuda_graphs:
        device = next(program.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs the model on a CUDA device; it is on {device}")


def compile_program(program: nn.Module, config: EngineConfig) -> Callable:
    """The step program to call: `program` itself in eager mode, else its Thunder-jitted twin."""
    check_compile_setup(program, config)
    if config.compile == "eager":
        return program
    thunder = import_thunder()
    from thunder_batch.compile import trace_speedups

    trace_speedups.install()  # same traces, less tracing time (see trace_speedups)
    return thunder.jit(program, **compile_options(config))


def load_or_compile_program(program: StepProgram, config: EngineConfig, probe_inputs=None) -> Callable:
    """The step program to call. Eager: `program` itself. trace="layers" (default): a LayeredProgram
    whose pieces are traced once per step shape or loaded from the compile cache (config.cache_dir) and
    checked against eager on `probe_inputs(rows, length)` (see LayeredProgram).
    trace="step": the whole step as one Thunder trace per shape, kept in memory only. With
    cuda_graphs, either is wrapped in a CUDAGraphProgram (one CUDA graph per step shape and head)."""
    check_compile_setup(program, config)  # fail at construction, not at the first step
    fn = _load_or_compile(program, config, probe_inputs)
    if not config.cuda_graphs:
        return fn
    from thunder_batch.compile.cuda_graphs import CUDAGraphProgram, CUDAGraphs

    return CUDAGraphProgram(fn, CUDAGraphs(next(program.parameters()).device))


def _load_or_compile(program: StepProgram, config: EngineConfig, probe_inputs) -> Callable:
    if config.compile == "eager" or config.trace == "step":
        return compile_program(program, config)
    import_thunder()  # the compat patches must come before any thunder import
    from thunder_batch.compile import block_op, project_executor, trace_speedups
    from thunder_batch.compile.cache import CompileCacheFiles, resolve_root
    from thunder_batch.compile.fusion import EXECUTOR as FUSION
    from thunder_batch.compile.layered import LayeredProgram

    trace_speedups.install()
    options = compile_options(config)
    names = {getattr(ex, "name", ex) for ex in options["executors"]}
    executors_on = {project_executor.EXECUTOR, FUSION} <= names  # the op stands for the fusion's regions
    block_op.mark_blocks(program, executors_on, config.batch_size, project_executor.native_linear)
    return LayeredProgram(
        program,
        config,
        options,
        CompileCacheFiles(resolve_root(config.cache_dir), next(program.parameters()).device),
        probe_inputs,
    )


def follow_weights(fn: Callable, moved: list) -> None:
    """After the `moved` weights were replaced (new tensors, or new data under the same ones; same shapes and
    dtypes) or written behind their version counters: every program of `fn` reads them from its next call on,
    their packed copies are made again, and nothing is retraced."""
    from thunder_batch.compile.cuda_graphs import CUDAGraphProgram
    from thunder_batch.compile.layered import LayeredProgram

    if not is_compiled(fn):
        return  # eager reads the model's modules as they are
    from thunder_batch._compat import rebind_thunder_module
    from thunder_batch.compile.project_executor import PACKED

    PACKED.refresh(moved)
    if isinstance(fn, CUDAGraphProgram):
        fn.graphs.clear()  # captured at the old addresses: captured again on their next call
    program = _unwrapped(fn)
    if isinstance(program, LayeredProgram):
        program.rebind()
    else:  # trace="step": Thunder's module
        rebind_thunder_module(program)


def is_compiled(fn: Callable) -> bool:
    return not isinstance(fn, nn.Module) or type(fn).__name__ == "ThunderModule"


@contextlib.contextmanager
def outputs_unused(fn: Callable):
    """Calls of `fn` in this context are warm-ups: their outputs are thrown away (see
    LayeredProgram.outputs_used; other step programs run as always)."""
    from thunder_batch.compile.layered import LayeredProgram

    layered = _unwrapped(fn)
    if not isinstance(layered, LayeredProgram):
        yield
        return
    layered.outputs_used = False
    try:
        yield
    finally:
        layered.outputs_used = True


def program_stats(fn: Callable) -> dict:
    """Counters of the step program: step shapes made (`cache_misses`), calls that reused one
    (`cache_hits`), programs made per piece (`programs`), how many were traced and how many loaded
    from the compile cache, the traces Thunder itself counts (`thunder_traces`: a retrace shows
    here even where the other counters would miss it), the seconds spent making them, whether the
    tracing speedups are on (`trace_speedups`: "on", or "off: why"), the slower paths this process
    took (`fallbacks`, see thunder_batch.fallbacks) and, with CUDA graphs, the graphs captured and
    replayed (`cuda_graphs`)."""
    from thunder_batch.compile import trace_speedups
    from thunder_batch.compile.cuda_graphs import CUDAGraphProgram
    from thunder_batch.compile.layered import LayeredProgram

    if isinstance(fn, CUDAGraphProgram):
        return fn.add_stats(program_stats(fn.program))
    if isinstance(fn, LayeredProgram):
        return dict(fn.stats(), trace_speedups=trace_speedups.status(), fallbacks=fallbacks.counts())
    stats = dict(
        cache_misses=0,
        cache_hits=0,
        programs={},
        traced=0,
        thunder_traces=0,
        not_stored=0,
        disk_cache_hits=0,
        compile_seconds=0.0,
        compile_seconds_by_piece={},
        trace_speedups="off: nothing is traced (eager)",
        fallbacks=fallbacks.counts(),
    )
    if is_compiled(fn):  # trace="step": one Thunder trace per shape
        thunder = import_thunder()
        misses = thunder.cache_misses(fn)
        stats.update(
            cache_misses=misses,
            cache_hits=thunder.cache_hits(fn),
            programs={"step": misses},
            traced=misses,
            thunder_traces=misses,
            not_stored=misses,
            trace_speedups=trace_speedups.status(),
        )
    return stats


def cache_misses(fn: Callable) -> int:
    """Step shapes made for `fn`: traced or loaded from the compile cache (0 for an eager program)."""
    return program_stats(fn)["cache_misses"]


def execution_traces(fn: Callable) -> list:
    """Thunder's final execution traces of the programs traced in this process: every piece of a
    layered program (prefix, blocks, heads), or the latest whole-step trace. Programs loaded from
    the compile cache have no trace object and are not listed."""
    from thunder_batch.compile.layered import LayeredProgram

    fn = _unwrapped(fn)
    if isinstance(fn, LayeredProgram):
        return fn.execution_traces()
    return [import_thunder().last_traces(fn)[-1]] if is_compiled(fn) and cache_misses(fn) else []


def _unwrapped(fn: Callable) -> Callable:
    """The step program inside `fn`'s CUDA graphs, if it has them; else `fn`."""
    from thunder_batch.compile.cuda_graphs import CUDAGraphProgram

    return fn.program if isinstance(fn, CUDAGraphProgram) else fn
