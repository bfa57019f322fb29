"""Thunder fusion regions compiled by Inductor once and stored: the "inductor" fusion executor.

Thunder's own torchcompile executor hands each region to `torch.compile`, so every call of a region
pays Dynamo's frame evaluation and guards (measured slower than no fusion at 1-8 rows on CPU:
benchmarks/RESULTS.md, "The fused step"), and nothing of it can be stored. Here a region (the same torch
ops Thunder would give torch.compile) is traced to an FX graph on its first call, with its real inputs
(shapes, dtypes, strides), compiled by Inductor's standalone compiler, and called directly afterwards: no
guards. The compiled artifact is stored under the compile cache root and loaded, checked, the next time
the same region appears: in a stored piece, or traced again (`fused_region`).

Regions never hold the KV cache writes (in place, see `inplace`), attention (the sdpa executor) or
linears (the project's kernels or torch): they fuse the elementwise work between them. A region of
views alone (reshapes, splits, transposes) is left to torch: it computes nothing.
"""

from __future__ import annotations

from thunder_batch._compat import import_thunder
from thunder_batch.compile.attention import WRITES_IN_PLACE
from thunder_batch.compile.fused_region import FusedRegion, make_region

EXECUTOR = "inductor"
REGION_PREFIX = "InductorFusion"
# Left to other executors: in-place writes, attention, matmuls (their own kernels are better).
NOT_FUSED = {
    "copy_",
    "index_copy",
    "index_copy_",
    "scatter",
    "scatter_",
    "index_put",
    "index_put_",
    "scaled_dot_product_attention",
    "linear",
    "matmul",
    "bmm",
    "_grouped_mm",  # the MoE step's grouped matmul: Inductor's meta for it takes bfloat16 only
}  # by op name: a torch symbol, or a prim of the same name it decomposes into


def make_executor():
    """The "inductor" FusionExecutor, registered with Thunder on first use."""
    import_thunder()
    from thunder.extend import get_executor, register_executor

    executor = get_executor(EXECUTOR)
    if executor is None:
        executor = _executor_class()(EXECUTOR)
        register_executor(executor)
    return executor


def _executor_class():
    from thunder.executors.torch_compile import TorchCompileExecutor
    from thunder.executors.torchex import ex as pytorch_ex
    from thunder.extend import ImplInfo

    class InductorFusionExecutor(TorchCompileExecutor):
        """Thunder's torchcompile partitioning, with regions made by `FusedRegion`."""

        def __init__(self, name: str) -> None:
            super().__init__(name)
            self._written: set[str] = set()  # proxies aliasing an in-place write, of the trace being fused
            self._implmap = {op: ImplInfo(checker=_on_cpu) for op in pytorch_ex.implmap if _fusable(op)}

        def fusion_pass(self, trace):
            self._written = written_aliases(trace.bound_symbols)
            # A region of views alone moves no data, and a compiled region's call costs many times a
            # torch view (benchmarks/RESULTS.md, "A decode-only step's attention as one op"); 4 of a
            # decode step's 9 regions per layer were views alone.
            self.required_ops = {b.sym.id for b in trace.bound_symbols if b.sym.name not in VIEW_OPS}
            return super().fusion_pass(trace)

        def can_fuse(self, bsym) -> bool:
            # Thunder would otherwise fuse an op whose decomposition it can fuse (attention as matmuls).
            if bsym.sym.name in NOT_FUSED:
                return False
            # A read of a buffer written in place (the KV cache) stays an op in program order: the
            # functional trace does not tie it to the write, and a region could run it before.
            return not any(p.name in self._written for p in bsym.flat_proxy_args) and super().can_fuse(bsym)

        def fuse(self, region, fusion_counter: int):
            from thunder.core.proxies import unvariableify
            from thunder.core.symbol import BoundSymbol, Symbol

            inputs = [unvariableify(x) for x in region.inputs]
            outputs = [unvariableify(x) for x in region.outputs]
            name = f"{REGION_PREFIX}{fusion_counter}"
            fused = region_function(region.bound_symbols, inputs, outputs, name)
            symbol = Symbol(name, meta=None, is_fusion=True, executor=self)
            return BoundSymbol(symbol, inputs, {}, outputs, region.bound_symbols, _call_ctx={name: fused})

    return InductorFusionExecutor


# Ops whose output may alias their first input (a view of it).
VIEW_OPS = {
    "view",
    "reshape",
    "getitem",
    "slice",
    "slice_prim",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "narrow",
    "flatten",
    "split",
    "chunk",
    "unflatten",
    "movedim",
    "contiguous",
}


def written_aliases(bound_symbols) -> set[str]:
    """Names of the proxies that alias a tensor some `copy_` (or a `WRITES_IN_PLACE` operator) writes in
    place (through views either way)."""
    root: dict[str, str] = {}

    def find(name: str) -> str:
        while root.get(name, name) != name:
            name = root[name]
        return name

    for bsym in bound_symbols:
        name, args = bsym.sym.name, bsym.flat_proxy_args
        # update_aliases: Thunder's mark that its arguments and results are one storage
        if (name in VIEW_OPS or name in ("update_aliases", "copy_")) and args:
            base = find(args[-1].name if name == "copy_" else args[0].name)
            for other in (*args, *bsym.flat_proxy_outs) if name != "copy_" else bsym.flat_proxy_outs:
                if find(other.name) != base:
                    root[find(other.name)] = base
    targets = {
        find(b.flat_proxy_args[1].name) for b in bound_symbols if b.sym.name == "copy_" and len(b.flat_proxy_args) > 1
    }
    for b in (b for b in bound_symbols if b.sym.name in WRITES_IN_PLACE):  # operators writing their arguments
        targets.update(find(b.args[i].name) for i in WRITES_IN_PLACE[b.sym.name])
    names = {p.name for b in bound_symbols for p in (*b.flat_proxy_args, *b.flat_proxy_outs)}
    return {n for n in names if find(n) in targets}


def _on_cpu(*args, **kwargs) -> bool:
    """CPU only: on CUDA, Thunder's own fusion executors (nvFuser, torchcompile) are the ones measured."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.pytree import tree_flatten

    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, TensorProxy)]
    return all(t.device.type == "cpu" for t in tensors)


def _fusable(op) -> bool:
    return str(op).split(".")[-1].lower() not in NOT_FUSED


def region_function(bsyms, inputs, outputs, name: str) -> FusedRegion:
    """The region as a trace of torch ops (as Thunder's torchcompile executor builds it), printed to source."""
    from thunder.core import prims
    from thunder.core.codeutils import SigInfo
    from thunder.core.trace import TraceCtx, tracectx
    from thunder.executors.passes import transform_for_execution
    from thunder.executors.torchex import ex as pytorch_ex

    trace = TraceCtx(None)
    trace.args, trace.kwargs = inputs, {}
    trace.names = {a.name for a in inputs}
    with tracectx(trace):
        for a in inputs:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += list(bsyms)
    trace.bound_symbols.append(prims.python_return.bind(outputs, output=None))
    for bsym in trace.bound_symbols:
        for out in (o for s in (bsym, *bsym.subsymbols) for o in s.flat_outs):
            if out is not None and out.name not in trace.names:
                trace.add_name(out.name)
    trace._siginfo = SigInfo("fused_region")
    trace._siginfo.args = [(a.name, None) for a in inputs]
    torch_trace = transform_for_execution(trace, executors_list=(pytorch_ex,))
    return make_region(name, torch_trace.python(include_decorators=False), torch_trace.python_ctx())
