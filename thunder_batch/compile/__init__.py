"""Thunder jit, executor choice and compiled-program inspection.

This package is the only place that touches Thunder: its submodules add the persistent compile
cache (cache, trace_export), the step traced piece by piece with layers sharing block traces
(layered, pieces, signature), in-place KV cache writes (inplace), cheaper cold tracing
(trace_speedups) and the `thunder-batch compile` command (cli).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from thunder_batch._compat import import_thunder
from thunder_batch.config import EngineConfig
from thunder_batch.program import StepProgram

# User-facing executor names, in the order they should claim ops (first wins).
KNOWN_EXECUTORS = ("nvfuser", "torchcompile", "sdpa", "torch", "python")

_MISSING = {
    "nvfuser": "nvFuser is not installed: Thunder found no `nvfuser` package (its wheels are built for one "
    "torch and CUDA version each, e.g. nvfuser-cu128-torch28)",
    "torchcompile": "Thunder's torch.compile executor is not registered (it needs torch >= 2.2)",
}


def executor_availability() -> dict[str, str | None]:
    """name -> None when usable here, else the reason it is not (for every name in KNOWN_EXECUTORS)."""
    thunder = import_thunder()
    from thunder.extend import get_executor

    status = {}
    for name in KNOWN_EXECUTORS:
        if get_executor(name) is None:
            status[name] = _MISSING.get(name, f"executor {name!r} is not registered with Thunder")
        elif name == "nvfuser" and not thunder.executors.nvfuser_available():
            status[name] = "nvFuser is installed but unusable here (no CUDA device or a version mismatch)"
        else:
            status[name] = None
    return status


def resolve_executors(names: Sequence[str]) -> list:
    """Executor objects for `names` (claim order); ValueError naming the unknown or unavailable ones."""
    import_thunder()  # the compat patches must come before any thunder import
    from thunder.extend import get_executor

    names = tuple(names)
    if not names:
        raise ValueError(
            f"executors is empty: name at least one of {list(KNOWN_EXECUTORS)}, or pass None for Thunder's defaults"
        )
    unknown = [n for n in names if n not in KNOWN_EXECUTORS]
    if unknown:
        raise ValueError(f"unknown executor(s) {unknown}; choose from {list(KNOWN_EXECUTORS)}")
    availability = executor_availability()
    missing = {n: availability[n] for n in names if availability[n] is not None}
    if missing:
        usable = [n for n, why in availability.items() if why is None]
        raise ValueError(
            "executor(s) not available here: "
            + "; ".join(f"{n}: {why}" for n, why in missing.items())
            + f". Available here: {usable}"
        )
    return [get_executor(n) for n in names]


def compile_options(config: EngineConfig) -> dict:
    """Keyword arguments for thunder.jit implied by the config."""
    options: dict = {}
    if config.executors is not None:
        options["executors"] = resolve_executors(config.executors)
        if "nvfuser" in config.executors:
            options["nv_enable_scatter"] = True  # lets nvFuser claim the KV cache scatter and the gathers
    from thunder_batch.compile.inplace import make_transform

    options["transforms"] = [make_transform()]  # KV cache writes in place, not two whole-cache copies
    if config.cuda_graphs:
        from thunder.transforms.cudagraph import CUDAGraphTransform

        # Module buffers (the KV caches) are static inputs: captured in place, written by every replay.
        options["transforms"].append(CUDAGraphTransform())
    return options


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


def executor_claims(trace) -> dict[str, int]:
    """Executor name -> top-level ops of an execution trace it runs. A fusion region (TorchCompile0,
    nvFusion0, CUDAGraph1) counts once, under its executor (CUDA graphs: 'CUDAGraphTransform')."""
    claims: dict[str, int] = {}
    for bsym in trace.bound_symbols:
        executor = bsym.sym.executor
        if executor is not None:
            name = getattr(executor, "name", None) or type(executor).__name__
            claims[name] = claims.get(name, 0) + 1
    return claims


def fusion_regions(trace) -> list[str]:
    """Names of the fusion regions in an execution trace, e.g. ['TorchCompile0'] or ['CUDAGraph1']."""
    return [bsym.sym.name for bsym in trace.bound_symbols if bsym.sym.is_fusion]


def compile_program(program: nn.Module, config: EngineConfig) -> Callable:
    """The step program to call: `program` itself in eager mode, else its Thunder-jitted twin."""
    check_compile_setup(program, config)
    if config.compile == "eager":
        return program
    if config.cuda_graphs:
        program.requires_grad_(False)  # else Thunder's CUDA graph transform fails on the second shape
    thunder = import_thunder()
    from thunder_batch.compile import trace_speedups

    trace_speedups.install()  # same traces, ~2x less tracing time (see trace_speedups)
    return thunder.jit(program, **compile_options(config))


def load_or_compile_program(program: StepProgram, config: EngineConfig) -> Callable:
    """The step program to call. Eager: `program` itself. trace="layers" (default): a LayeredProgram
    whose pieces are traced once per step shape or loaded from the compile cache (config.cache_dir).
    trace="step": the whole step as one Thunder trace per shape, kept in memory only."""
    check_compile_setup(program, config)  # fail at construction, not at the first step
    if config.compile == "eager" or config.trace == "step":
        return compile_program(program, config)
    import_thunder()  # the compat patches must come before any thunder import
    from thunder_batch.compile import trace_speedups
    from thunder_batch.compile.cache import EntryStore, resolve_root
    from thunder_batch.compile.layered import LayeredProgram

    trace_speedups.install()
    return LayeredProgram(
        program,
        config,
        compile_options(config),
        lambda: describe_options(config),
        EntryStore(resolve_root(config.cache_dir)),
    )


def describe_options(config: EngineConfig) -> tuple[tuple[str, ...], dict]:
    """(executor names in claim order, the other jit options as plain data): part of the cache key."""
    thunder = import_thunder()
    options = compile_options(config)
    executors = options.pop("executors", None) or thunder.get_default_executors()
    names = tuple(ex.name for ex in (*executors, *thunder.get_always_executors()))
    options["transforms"] = [type(t).__name__ for t in options.get("transforms", ())]
    return names, options


def is_compiled(fn: Callable) -> bool:
    return not isinstance(fn, nn.Module) or type(fn).__name__ == "ThunderModule"


def program_stats(fn: Callable) -> dict:
    """Counters of the step program: step shapes made (`cache_misses`), calls that reused one
    (`cache_hits`), programs made per piece (`programs`), how many were traced and how many loaded
    from the compile cache, and the seconds spent making them."""
    from thunder_batch.compile.layered import LayeredProgram

    if isinstance(fn, LayeredProgram):
        return fn.stats()
    stats = dict(
        cache_misses=0,
        cache_hits=0,
        programs={},
        traced=0,
        not_stored=0,
        disk_cache_hits=0,
        compile_seconds=0.0,
        compile_seconds_by_piece={},
    )
    if is_compiled(fn):  # trace="step": one Thunder trace per shape
        thunder = import_thunder()
        misses = thunder.cache_misses(fn)
        stats.update(
            cache_misses=misses,
            cache_hits=thunder.cache_hits(fn),
            programs={"step": misses},
            traced=misses,
            not_stored=misses,
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

    if isinstance(fn, LayeredProgram):
        return fn.execution_traces()
    return [import_thunder().last_traces(fn)[-1]] if is_compiled(fn) and cache_misses(fn) else []
