"""KV cache writes in place under Thunder's torch executor.

Thunder turns the cache write
`t.index_copy_(dim, idx, val)` (likewise `scatter_`) into `u = index_copy(t, dim, idx, val)` (a new
tensor: a full copy of the cache) then `copy_(u, t)` (a second full copy). That is four whole-cache
copies per layer per step, where eager writes only the step's N new entries. `InplaceScatter` rewrites
each such pair the torch executor runs into the in-place op; the `copy_` that follows then copies
the buffer onto itself, which torch skips. Fused regions (torch.compile, nvFuser) are left alone:
they plan their own writes.
"""

from __future__ import annotations

import torch

from thunder_batch._compat import import_thunder

OPERATOR = "thunder_batch_scatter_into"
INDEX_COPY_OPERATOR = "thunder_batch_index_copy_into"


def scatter_into(a: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`a.scatter_(dim, index, src)`, returning `a` itself (so a later `copy_(result, a)` is a no-op)."""
    return a.scatter_(dim, index, src)


def index_copy_into(a: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`a.index_copy_(dim, index, src)`, returning `a` itself (the KV cache write, see index_ops)."""
    return a.index_copy_(dim, index, src)


# The torch executor's out-of-place op -> (Thunder operator name, the in-place function running it).
IN_PLACE = {"scatter": (OPERATOR, scatter_into), "index_copy": (INDEX_COPY_OPERATOR, index_copy_into)}


def _operators() -> dict:
    """op name -> the Thunder symbol running its in-place twin, registered once with our executor."""
    from thunder.core.proxies import TensorProxy

    from thunder_batch.compile.project_executor import project_executor

    executor = project_executor()
    for name, fn in IN_PLACE.values():
        if name not in executor.opmap:
            executor.register_operator(name, meta=lambda a, dim, index, src: TensorProxy(like=a), fn=fn)
    return {op: executor.opmap[name] for op, (name, _) in IN_PLACE.items()}


def rewrite(bound_symbols: list) -> tuple[list, int]:
    """(new bound symbols, pairs rewritten). A pair qualifies when the torch executor runs
    `u = scatter(t, ...)` or `u = index_copy(t, ...)`, a later `copy_(u, t)` writes it back, and
    nothing else reads `u` or reads/writes `t` in between (an earlier in-place write would change
    what they see)."""
    operators = _operators()
    out, rewritten = list(bound_symbols), 0
    for i, bsym in enumerate(bound_symbols):
        if not _is_torch_out_of_place(bsym):
            continue
        if _written_back(bound_symbols, i, target=bsym.args[0], result=bsym.output):
            out[i] = operators[bsym.sym.name].bind(*bsym.args, output=bsym.output)
            rewritten += 1
    return out, rewritten


def _is_torch_out_of_place(bsym) -> bool:
    executor = bsym.sym.executor
    return (
        bsym.sym.name in IN_PLACE
        and getattr(executor, "name", None) == "torch"
        and len(bsym.args) == 4
        and not bsym.kwargs
    )


def _written_back(bound_symbols: list, i: int, target, result) -> bool:
    """True when a later `copy_(result, target)` follows position i with nothing between touching either."""
    for bsym in bound_symbols[i + 1 :]:
        if bsym.sym.name == "copy_" and len(bsym.args) >= 2 and bsym.args[0] is result and bsym.args[1] is target:
            return True
        if bsym.sym.name == "python_del":
            continue
        if {result.name, target.name} & {p.name for p in bsym.flat_proxy_args}:
            return False
    return False


def make_transform():
    """A Thunder post-optimization transform applying `rewrite` to the computation trace."""
    import_thunder()
    from thunder.core.trace import TraceProvenance, from_trace
    from thunder.core.transform_common import Transform

    class InplaceScatter(Transform):
        def transform_trace_post_optimization(self, trace, **kwargs):
            bound_symbols, count = rewrite(trace.bound_symbols)
            if not count:
                return trace
            new = from_trace(trace)
            new.bound_symbols = bound_symbols
            new.set_provenance(TraceProvenance(f"InplaceScatter: {count} cache writes in place"))
            return new

    return InplaceScatter()
