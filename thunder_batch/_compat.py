"""torch / Thunder compatibility, applied before `thunder` is imported (and one fix right after).

torch 2.13 removed the named-tensor methods that Thunder 0.2.7's op table still lists
(`Tensor.align_as`, ...). Thunder only needs the attributes to exist and to carry their own
`__name__`; calling one raises, as named tensors are gone. Methods torch still has are left alone.

Thunder 0.2.7 cannot run `torch._grouped_mm` (the mixture-of-experts step's grouped matmul): its
torch executor's checker takes three arguments where the traced call passes five (a TypeError), and
its torchcompile executor claims it in every dtype where Inductor takes bfloat16 only.

A compiled artifact of `torch._inductor.standalone_compile` runs its generated code through
AOTAutograd's runtime wrappers: ~half of a small fusion region's host time (`inductor_graph_call`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

REMOVED_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename", "rename_")


def _removed_method(name: str):
    def method(self, *args, **kwargs):
        raise RuntimeError(f"torch.Tensor.{name} was removed from torch (named tensors are gone)")

    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    return method


def patch_torch_for_thunder() -> list[str]:
    """Add stand-ins for the named-tensor methods this torch lacks; returns the names added."""
    added = []
    for name in REMOVED_NAMED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _removed_method(name))
            added.append(name)
    return added


def import_thunder():
    """Import thunder with the compatibility patches applied; the one entry point to thunder."""
    patch_torch_for_thunder()
    import thunder

    patch_thunder_grouped_mm()
    return thunder


def patch_thunder_grouped_mm() -> list[str]:
    """The torch executor runs `_grouped_mm` in whatever dtype torch itself does (the step uses it
    only where a probe ran it); torchcompile takes it in bfloat16 only. Returns the executors patched."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.executors import torch_compile, torchex

    patched = []
    for executor, checker in ((torchex.ex, _torch_runs), (torch_compile.torch_compile_ex, _inductor_runs)):
        for symbol in (getattr(ltorch, "_grouped_mm", None), getattr(prims, "_grouped_mm", None)):
            impl = executor.implmap.get(getattr(symbol, "id", None))
            if impl is not None and impl.checker is not checker:
                impl.checker = checker
                patched.append(executor.name)
    return sorted(set(patched))


def _torch_runs(a, b, offsets, *rest, **kwargs) -> bool:
    from thunder.core import dtypes

    return offsets is not None and offsets.dtype == dtypes.int32


def _inductor_runs(a, b, offsets, *rest, **kwargs) -> bool:
    from thunder.core import dtypes

    return _torch_runs(a, b, offsets) and a.dtype == b.dtype == dtypes.bfloat16


def inductor_graph_call(compiled) -> Callable | None:
    """The generated code inside a `standalone_compile` artifact (fresh or loaded), called without
    AOTAutograd's runtime wrappers; None unless exactly one compiled graph is found under them (torch
    internals: the wrappers' closures). Its callers compare its outputs with the wrapped call's first."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, todo = [], set(), [(compiled, 0)]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > 12:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found.append(obj)
            continue
        inner = [_contents(c) for c in getattr(obj, "__closure__", None) or ()]
        inner += [v for v in (getattr(obj, "__dict__", None) or {}).values() if callable(v)]
        todo += [(v, depth + 1) for v in inner if v is not None and not isinstance(v, type)]
    if len(found) != 1 or found[0].current_callable is None:
        return None
    call = found[0].current_callable  # takes a list of inputs, which it empties
    # The profiler event CompiledFxGraph's own call records, so that a profile still shows each region
    event = f"## Call CompiledFxGraph {found[0]._fx_graph_cache_key} ##"

    def direct(*args):
        if torch.autograd.profiler._is_profiler_enabled:
            with torch._C._profiler._RecordFunctionFast(event, keyword_values={"scope": "user_scope"}):
                return list(call(list(args)))
        return list(call(list(args)))

    return direct


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def rebind_thunder_module(jitted) -> None:
    """A Thunder-jitted module reads its model's parameters from a name -> tensor table made when it was
    jitted (Thunder's private `_overrides_parameters`); after a parameter was replaced by a new tensor the
    table is made again from the model, so the next call reads the new one."""
    jitted._overrides_parameters = dict(jitted._model.named_parameters())
