"""Thunder executors by name: which are usable here (and why not), in claim order, and what a
compiled trace shows of them (ops each executor claims, fusion regions)."""

from __future__ import annotations

from collections.abc import Sequence

from thunder_batch._compat import import_thunder

# User-facing executor names, in the order they should claim ops (first wins). "thunder_batch" is the
# project's own (compile.project_executor): small-row linears on CPU.
# "inductor" fuses the elementwise work between them with Inductor, stored in the compile cache (compile.fusion).
KNOWN_EXECUTORS = ("thunder_batch", "sdpa", "inductor", "nvfuser", "torchcompile", "torch", "python")

_MISSING = {
    "nvfuser": "nvFuser is not installed: Thunder found no `nvfuser` package (its wheels are built for one "
    "torch and CUDA version each, e.g. nvfuser-cu128-torch28)",
    "torchcompile": "Thunder's torch.compile executor is not registered (it needs torch >= 2.2)",
}


def executor_availability() -> dict[str, str | None]:
    """name -> None when usable here, else the reason it is not (for every name in KNOWN_EXECUTORS)."""
    thunder = import_thunder()
    from thunder.extend import get_executor

    from thunder_batch.compile.project_executor import project_executor

    status = {}
    from thunder_batch.compile.fusion import make_executor

    project_executor()  # registers "thunder_batch" (its checker says which ops it can take here)
    make_executor()  # registers "inductor"
    for name in KNOWN_EXECUTORS:
        if get_executor(name) is None:
            status[name] = _MISSING.get(name, f"executor {name!r} is not registered with Thunder")
        elif name == "nvfuser" and not thunder.executors.nvfuser_available():
            status[name] = "nvFuser is installed but unusable here (no CUDA device or a version mismatch)"
        else:
            status[name] = None
    return status


def default_executors() -> list:
    """`executors=None`, a fixed choice (measured: benchmarks/RESULTS.md), not measured at run time: the
    project's executor (packed CPU linears, compile.project_executor), Thunder's sdpa, the "inductor"
    fusion of what lies between them (CPU only, compile.fusion), torch, then the rest of Thunder's
    defaults for the device."""
    thunder = import_thunder()
    from thunder.executors.torchex import ex as torch_executor

    from thunder_batch.compile.fusion import make_executor
    from thunder_batch.compile.project_executor import project_executor

    sdpa = [ex for ex in thunder.get_default_executors() if ex.name == "sdpa"]
    rest = [ex for ex in thunder.get_default_executors() if ex.name not in ("sdpa", torch_executor.name)]
    # torch right after the fusion takes what it leaves (attention, cache writes, big fp32 linears)
    # whole: an op no executor of the list takes would be decomposed into ops the fusion takes.
    return [project_executor(), *sdpa, make_executor(), torch_executor, *rest]


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


def describe_options(options: dict) -> tuple[tuple[str, ...], dict]:
    """(executor names in claim order, the other jit options as plain data) of the thunder.jit `options`
    a piece is traced with: what the cache key records of them."""
    thunder = import_thunder()
    data = {k: v for k, v in options.items() if k != "executors"}
    names = tuple(ex.name for ex in (*options["executors"], *thunder.get_always_executors()))
    data["transforms"] = [type(t).__name__ for t in data.get("transforms", ())]
    return names, data
