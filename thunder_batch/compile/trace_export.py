"""Export a Thunder-traced program as Python source, load it back without tracing, bind it to a module.

Thunder cannot save a compiled program, but its final computation trace prints as Python source
that, exec'd with the trace's context names, reproduces the program bit for bit. A record holds
that source, how to re-import every context name, and which module tensor or call argument feeds
each computation input (found by identity through the prologue, which is bypassed on load). The
same bindings, resolved against another module's tensors, let layers share one trace.
Anything that cannot be re-imported exactly (a torch.compile or nvFuser fusion region, a CUDA
graph runner, a closure) makes the program not exportable: it then stays in memory only.
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable, Sequence

import torch
from torch import nn

from thunder_batch._compat import import_thunder
from thunder_batch.compile.attention import WRITES_IN_PLACE
from thunder_batch.compile.cache import tensor_meta

# Context objects of these types are compiled regions, not importable code: never stored.
FUSION_KINDS = {
    "TorchCompile": "a torch.compile (Inductor) region: a closure over compiled code, not source",
    "nvFusion": "an nvFuser FusionDefinition: built by nvFuser at trace time, not source",
    "CUDAGraph": "a CUDA graph runner holding captured device state",
}


class NotExportable(Exception):
    """The traced program cannot be stored as source; the reason says which part and why."""


def computation_and_inputs(jitted, args: Sequence[torch.Tensor]):
    """(Thunder's cache entry for `args`, the computation inputs its prologue unpacks); call
    `jitted(*args)` first. Raises NotExportable when the program needs more than its computation."""
    thunder = import_thunder()
    entry, inputs, pro_to_epi = thunder.compile_data(jitted).get_computation_and_inputs(*args)
    if entry.backward_fn is not None:
        raise NotExportable("the program has a backward pass (trace under torch.no_grad)")
    if pro_to_epi:
        raise NotExportable("the prologue passes values to the epilogue")
    return entry, inputs


def export_record(entry, bindings: list[list]) -> dict:
    """JSON-able record of a computation: its source, how to re-import its names, its inputs."""
    trace = entry.computation_traces[-1]
    return dict(
        fn_name=trace.siginfo().name,
        source=trace.python(),
        ctx={name: ctx_recipe(name, obj) for name, obj in sorted(trace.python_ctx().items())},
        inputs=bindings,
        input_names=[a.name for a in trace.args],
        writes=sorted(_written_inputs(trace)),
        single_output=single_output(entry),
    )


def single_output(entry) -> bool:
    """Whether the program returns one value (the computation returns a 1-tuple of it). The epilogue
    must hand the computation's outputs back unchanged: it is skipped when running the computation."""
    probes = tuple(object() for _ in inspect.signature(entry.epilogue_fn).parameters)
    try:
        out = entry.epilogue_fn(*probes)
    except Exception as e:
        raise NotExportable(f"the epilogue does work of its own ({e})") from e
    returned = out if isinstance(out, tuple) else (out,)
    if len(returned) != len(probes) or not all(a is b for a, b in zip(returned, probes)):
        raise NotExportable("the epilogue does not return the computation's outputs unchanged")
    return not isinstance(out, tuple)


def input_bindings(inputs, args: Sequence[torch.Tensor], module: nn.Module) -> list[list]:
    """Per computation input: ["arg", i] or ["tensor", qualified name in `module`]."""
    named = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        named.setdefault(id(t), name)  # a tied weight keeps its first name; get_parameter finds the same tensor
    positions = {id(a): i for i, a in enumerate(args)}
    bindings = []
    for i, value in enumerate(inputs):
        if id(value) in positions:
            bindings.append(["arg", positions[id(value)]])
        elif id(value) in named:
            bindings.append(["tensor", named[id(value)], tensor_meta(value)])
        else:
            raise NotExportable(
                f"computation input {i} ({type(value).__name__}) is neither an argument "
                "nor a parameter/buffer of the module"
            )
    return bindings


def _written_inputs(trace) -> set[str]:
    """Names of computation inputs the program writes in place: targets of Thunder's copy_ and of the
    project's operators that write arguments (`WRITES_IN_PLACE`), followed back through update_aliases
    and views to the input they alias."""
    root: dict[str, str] = {}
    written = set()
    for bsym in trace.bound_symbols:
        if bsym.sym.name == "update_aliases":
            for before, after in zip(bsym.args[0], bsym.output):
                root[after.name] = root.get(before.name, before.name)
        elif bsym.sym.name == "view":  # a write through a view writes the viewed tensor
            root[bsym.output.name] = root.get(bsym.args[0].name, bsym.args[0].name)
        elif bsym.sym.name == "copy_":
            target = root.get(bsym.args[1].name, bsym.args[1].name)
            written.add(target)
            root[bsym.output.name] = target  # copy_ returns its target
        elif bsym.sym.name in WRITES_IN_PLACE:  # an operator writing some arguments, unseen by Thunder
            written.update(root.get(bsym.args[i].name, bsym.args[i].name) for i in WRITES_IN_PLACE[bsym.sym.name])
    return written & {a.name for a in trace.args}


# -- context names --------------------------------------------------------------------------------
def ctx_recipe(name: str, obj) -> list[str]:
    """How to get `obj` back in a fresh process; it must round-trip to the very same object here
    (a region of the "inductor" fusion executor: its source, and its compiled artifact on disk)."""
    from thunder_batch.compile.fused_region import FusedRegion

    if isinstance(obj, FusedRegion):
        if not obj.stored:
            raise NotExportable(f"fusion region {obj.name} was never compiled or not saved")
        return obj.recipe(ctx_recipe)
    for kind, label in FUSION_KINDS.items():
        if name.startswith(kind) or type(obj).__name__.startswith(kind):
            raise NotExportable(f"context name {name!r} is {label}")
    for recipe in _candidate_recipes(name, obj):
        try:
            if resolve_recipe(recipe) is obj:
                return recipe
        except Exception:
            continue
    raise NotExportable(
        f"context name {name!r} ({type(obj).__name__} from {getattr(obj, '__module__', '?')}) is not importable"
    )


def _candidate_recipes(name: str, obj):
    if isinstance(obj, types.ModuleType):
        yield ["module", obj.__name__]
        return
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname:
        yield ["attr", module, qualname]
    if module:  # bound under another name in its module (e.g. an alias)
        for attr, value in vars(importlib.import_module(module)).items():
            if value is obj:
                yield ["attr", module, attr]
    yield from (["executor_op", ex_name, name] for ex_name in _executors_with_op(name))


def _executors_with_op(name: str) -> list[str]:
    from thunder.extend import get_all_executors

    return [ex.name for ex in get_all_executors() if name in getattr(ex, "opmap", {})]


def resolve_recipe(recipe: Sequence[str]):
    """The object a ctx recipe names (importing as needed); raises if it no longer exists."""
    kind, *rest = recipe
    if kind == "module":
        return importlib.import_module(rest[0])
    if kind == "attr":
        obj = importlib.import_module(rest[0])
        for part in rest[1].split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "inductor":
        from thunder_batch.compile.fused_region import FusedRegion

        return FusedRegion.from_recipe(list(recipe), resolve_recipe)
    if kind == "executor_op":  # an operator registered with an implementation lambda (no import path)
        from thunder.extend import get_executor

        bound = get_executor(rest[0]).opmap[rest[1]].bind(output=None)
        return bound._call_ctx[rest[1]]
    raise ValueError(f"unknown ctx recipe kind {kind!r}")


# -- loading --------------------------------------------------------------------------------------
def load_computation(record: dict) -> Callable:
    """The stored computation as a function, compiled from its source with its context names."""
    import_thunder()  # the source imports thunder.executors.torchex; apply the torch patches first
    ctx = {name: resolve_recipe(recipe) for name, recipe in record["ctx"].items()}
    code = compile(record["source"], f"thunder_batch.cached.{record['fn_name']}", "exec")
    exec(code, ctx)
    return ctx[record["fn_name"]]


class BoundComputation:
    """A computation bound to one module's tensors: called like the jitted module, no prologue.

    bindings: per computation input, ["arg", i] or ["tensor", qualified name, metadata];
    written: qualified names of the module buffers the computation writes in place;
    single: the program returns one value (the computation, a 1-tuple)."""

    def __init__(
        self,
        computation: Callable,
        bindings: Sequence,
        module: nn.Module,
        written: Sequence[str] = (),
        single: bool = False,
    ):
        self.computation, self.single = computation, single
        self.module, self._recorded = module, bindings
        self.bindings = [_resolve_binding(b, module) for b in bindings]
        self.writes = [module.get_buffer(name) for name in written]

    def rebind(self) -> None:
        """Take the module's tensors afresh (a weight replaced by a new tensor since binding)."""
        self.bindings = [_resolve_binding(b, self.module) for b in self._recorded]

    def __call__(self, *args: torch.Tensor):
        # Dispatch by signature is the caller's job (as Thunder's prologue checks would be).
        out = self.computation(*(args[b] if isinstance(b, int) else b for b in self.bindings))
        return out[0] if self.single else out


def _resolve_binding(binding: Sequence, module: nn.Module):
    """The call-argument index, or the module tensor (checked against its recorded shape/dtype)."""
    if binding[0] == "arg":
        return int(binding[1])
    _, name, meta = binding
    tensor = module_tensor(module, name)
    if tensor_meta(tensor) != list(meta):
        raise ValueError(f"{name} is {tensor_meta(tensor)}, the stored program expects {meta}")
    return tensor


def module_tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer of `module` with this qualified name."""
    try:
        return module.get_parameter(name)
    except AttributeError:
        return module.get_buffer(name)


def written_names(record: dict) -> list[str]:
    """Module buffers the program writes in place (trace input names -> binding names)."""
    written = set(record["writes"])
    return [b[1] for b, n in zip(record["inputs"], record["input_names"]) if n in written and b[0] == "tensor"]


def written_in_trace(entry, bindings: Sequence) -> list[str]:
    """`written_names` for a computation still in memory."""
    trace = entry.computation_traces[-1]
    record = dict(writes=_written_inputs(trace), inputs=bindings, input_names=[a.name for a in trace.args])
    return written_names(record)
