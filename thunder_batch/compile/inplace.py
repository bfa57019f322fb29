"""KV cache writes in place under Thunder's torch executor.

Thunder turns the cache write `t.scatter_(dim, idx, val)` into `u = scatter(t, dim, idx, val)` (a new
tensor: a full copy of the cache) then `copy_(u, t)` (a second full copy). That is four whole-cache
copies per layer per step, where eager writes only the B x T new entries. `InplaceScatter` rewrites
each such pair the torch executor runs into one in-place `scatter_`; the `copy_` that follows then
copies the buffer onto itself, which torch skips. Fused regions (torch.compile, nvFuser) are left
alone: they plan their own writes.
"""

from __future__ import annotations

import torch

from thunder_batch._compat import import_thunder

OPERATOR = "thunder_batch_scatter_into"


def scatter_into(a: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`a.scatter_(dim, index, src)`, returning `a` itself (so a later `copy_(result, a)` is a no-op)."""
    return a.scatter_(dim, index, src)


def _operator():
    """The Thunder symbol running `scatter_into`, registered once with its own executor."""
    import_thunder()
    from thunder.core.proxies import TensorProxy
    from thunder.extend import OperatorExecutor, get_executor, register_executor

    executor = get_executor("thunder_batch")
    if executor is None:
        executor = OperatorExecutor("thunder_batch", version="1")
        register_executor(executor)
    if OPERATOR not in executor.opmap:
        executor.register_operator(OPERATOR, meta=lambda a, dim, index, src: TensorProxy(like=a), fn=scatter_into)
    return executor.opmap[OPERATOR]


def rewrite(bound_symbols: list) -> tuple[list, int]:
    """(new bound symbols, pairs rewritten). A pair qualifies when the torch executor runs
    `u = scatter(t, ...)`, a later `copy_(u, t)` writes it back, and nothing else reads `u` or
    reads/writes `t` in between (an earlier in-place write would change what they see)."""
    op = _operator()
    out, rewritten = list(bound_symbols), 0
    for i, bsym in enumerate(bound_symbols):
        if not _is_torch_scatter(bsym):
            continue
        if _written_back(bound_symbols, i, target=bsym.args[0], result=bsym.output):
            out[i] = op.bind(*bsym.args, output=bsym.output)
            rewritten += 1
    return out, rewritten


def _is_torch_scatter(bsym) -> bool:
    executor = bsym.sym.executor
    return (bsym.sym.name == "scatter" and getattr(executor, "name", None) == "torch" and len(bsym.args) == 4
            and not bsym.kwargs)


def _written_back(bound_symbols: list, i: int, target, result) -> bool:
    """True when a later `copy_(result, target)` follows position i with nothing between touching either."""
    for bsym in bound_symbols[i + 1:]:
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
