"""The only module that imports Thunder: jit, executor choice, and compiled-program inspection."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from thunder_batch._compat import import_thunder
from thunder_batch.config import EngineConfig

# User-facing executor names, in the order they should claim ops (first wins).
KNOWN_EXECUTORS = ("nvfuser", "torchcompile", "sdpa", "torch", "python")


def executor_availability() -> dict[str, str | None]:
    """name -> None when usable here, else the reason it is not."""
    thunder = import_thunder()
    from thunder.extend import get_executor

    status = {}
    for name in KNOWN_EXECUTORS:
        ex = get_executor(name)
        if ex is None:
            status[name] = f"executor {name!r} is not installed (Thunder found no {name} package)"
        elif name == "nvfuser" and not thunder.executors.nvfuser_available():
            status[name] = "nvFuser is not installed or has no CUDA device"
        else:
            status[name] = None
    return status


def resolve_executors(names: Sequence[str]) -> list:
    """Executor objects for `names`; ValueError naming the unknown or unavailable ones."""
    from thunder.extend import get_executor

    unknown = [n for n in names if n not in KNOWN_EXECUTORS]
    if unknown:
        raise ValueError(f"unknown executor(s) {unknown}; choose from {list(KNOWN_EXECUTORS)}")
    availability = executor_availability()
    missing = {n: availability[n] for n in names if availability[n] is not None}
    if missing:
        raise ValueError("unavailable executor(s): " + "; ".join(f"{n}: {why}" for n, why in missing.items()))
    return [get_executor(n) for n in names]


def compile_options(config: EngineConfig) -> dict:
    """Keyword arguments for thunder.jit implied by the config."""
    options: dict = {}
    if config.executors is not None:
        options["executors"] = resolve_executors(config.executors)
        if "nvfuser" in config.executors:
            options["nv_enable_scatter"] = True  # lets nvFuser claim the KV cache scatter
    if config.cuda_graphs:
        from thunder.transforms.cudagraph import CUDAGraphTransform

        options["transforms"] = [CUDAGraphTransform()]
    return options


def compile_program(program: nn.Module, config: EngineConfig) -> Callable:
    """The step program to call: `program` itself in eager mode, else its Thunder-jitted twin."""
    if config.compile == "eager":
        if config.cuda_graphs or config.executors is not None:
            raise ValueError("executors and cuda_graphs need compile='thunder'")
        return program
    thunder = import_thunder()
    return thunder.jit(program, **compile_options(config))


def is_compiled(fn: Callable) -> bool:
    return not isinstance(fn, nn.Module) or type(fn).__name__ == "ThunderModule"


def cache_misses(fn: Callable) -> int:
    """Traces Thunder made for `fn` (0 for an eager program)."""
    if not is_compiled(fn):
        return 0
    return import_thunder().cache_misses(fn)


def cache_hits(fn: Callable) -> int:
    if not is_compiled(fn):
        return 0
    return import_thunder().cache_hits(fn)


def last_execution_trace(fn: Callable):
    """The final execution trace of the most recent call (for inspection in tests and tools)."""
    return import_thunder().last_traces(fn)[-1]
