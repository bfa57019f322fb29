"""Thunder fusion regions compiled by Inductor once and stored: the "inductor" fusion executor.

Thunder's own torchcompile executor hands each region to `torch.compile`, so every call of a region
pays Dynamo's frame evaluation and guards (measured: slower than no fusion at 1-8 rows on CPU), and
nothing of it can be stored. Here a region (the same torch ops Thunder would give torch.compile) is
traced to an FX graph on its first call, with its real inputs (shapes, dtypes, strides), compiled by
Inductor's standalone compiler, and called directly afterwards: no guards. The compiled artifact is
saved under the compile cache root (`<root>/inductor/<digest>.bin`, digest over the region's source
and its inputs' metadata) and loaded, after a SHA-256 check, the next time the same region appears:
in a stored piece, or traced again. Inductor's own caches live there too.

Regions never hold the KV cache writes (in place, see `inplace`), attention (the sdpa executor) or
linears (the project's kernels or torch): they fuse the elementwise work between them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import inspect
import os
from pathlib import Path

import torch

from thunder_batch import fallbacks
from thunder_batch._compat import import_thunder

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
_artifact_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("artifact_dir", default=None)
_as_torch_ops: contextvars.ContextVar[bool] = contextvars.ContextVar("as_torch_ops", default=False)


@contextlib.contextmanager
def regions_as_torch_ops():
    """Inside, fusion regions run their torch ops instead of their compiled code (a stored piece's
    load-time check compares its program with eager; each compiled region is checked on its own)."""
    token = _as_torch_ops.set(True)
    try:
        yield
    finally:
        _as_torch_ops.reset(token)


def regions_of(computation) -> list[FusedRegion]:
    """The fusion regions a stored or traced computation calls: they live in its globals (a stored
    one comes wrapped, as `torch.no_grad` wraps it)."""
    inner = inspect.unwrap(computation)
    return [v for v in getattr(inner, "__globals__", {}).values() if isinstance(v, FusedRegion)]


def has_regions(computation) -> bool:
    return bool(regions_of(computation))


@contextlib.contextmanager
def artifacts_in(root: Path | None):
    """Regions made inside this context store and find their compiled artifacts under `root`/inductor."""
    if root is not None:
        _root_inductor_caches(Path(root) / "inductor-cache")
    token = _artifact_dir.set(None if root is None else Path(root) / "inductor")
    try:
        yield
    finally:
        _artifact_dir.reset(token)


def _root_inductor_caches(path: Path) -> None:
    """Inductor's own caches (compiled C++, FX graphs) under the compile cache root, unless the user
    chose a place ($TORCHINDUCTOR_CACHE_DIR): Inductor writes its default there itself on first use.
    Which SIMD instructions the compiler and CPU allow is a fact of the machine, not of a compile: it
    is probed first, in Inductor's default place (~7 s of test builds once per machine, not per root)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        cpu_vec_isa.pick_vec_isa()  # probed once per process, its test builds kept where every root finds them
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.absolute())


def _checked_bytes(path: Path, hash_path: Path, expected: str | None) -> tuple[bytes, str | None]:
    """(the artifact's bytes, what is wrong with them or None): a safe file whose SHA-256 is the one
    written beside it at save time and, if a stored piece names one, `expected`."""
    from thunder_batch.compile.cache import sha256, unsafe_reason

    problem = unsafe_reason(path, directory=False)
    if problem is not None:
        return b"", problem
    if not hash_path.exists():
        return b"", "no content hash beside it (written before hashes were, or cut short)"
    problem = unsafe_reason(hash_path, directory=False)
    data = path.read_bytes()
    if problem is None and hash_path.read_text().strip() != sha256(data):
        problem = "content hash mismatch (damaged or edited)"
    if problem is None and expected not in (None, sha256(data)):
        problem = "not the artifact the stored piece names (content hash mismatch)"
    return data, problem


def _all_close(got, want) -> bool:
    got, want = _tensors(got), _tensors(want)
    return len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))


def _tensors(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _close(got, want) -> bool:
    """Inductor computes a region's elementwise chain in float32 and rounds once; torch's ops round each
    step: for 16-bit floats they differ by a few units in the last place."""
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return isinstance(got, torch.Tensor) is isinstance(want, torch.Tensor) and not isinstance(got, torch.Tensor)
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    tol = 1e-4 if got.dtype == torch.float32 or got.dtype == torch.float64 else 3e-2
    return torch.allclose(got, want, rtol=tol, atol=tol)


def _meta(t) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), t.device.type] if isinstance(t, torch.Tensor) else [repr(t)]


class FusedRegion:
    """A region's torch function, compiled by Inductor on first call (or loaded) and called directly.

    source: the region as Python (Thunder's torch-executor trace of it); fn: that source as a function.
    A compiled artifact is stored as `<digest>.bin` with its SHA-256 in `<digest>.sha256`, written at
    save time: a loaded artifact must match it (and, when a stored piece names one, that hash too), and
    its first outputs must match its torch ops. A region that cannot be compiled runs its torch ops.
    """

    def __init__(self, name: str, source: str, fn, artifact_dir: Path | None) -> None:
        self.name, self.source, self.fn, self.artifact_dir = name, source, fn, artifact_dir
        self.compiled = None
        self.digest: str | None = None
        self.artifact_sha: str | None = None
        self.loaded = False  # the compiled artifact came from disk
        self.unchecked = False  # loaded, its outputs not yet compared with its torch ops

    def __call__(self, *args):
        if _as_torch_ops.get():
            return self.fn(*args)
        if self.compiled is None:
            self._make(args)
        if self.unchecked:
            return self._first_loaded_call(args)
        try:
            return self.compiled(*args)
        except AssertionError:  # inputs with other strides than the compiled ones: run the torch ops
            fallbacks.report("region_strides", f"fusion region {self.name} called with other strides: torch ops ran")
            return self.fn(*args)

    def _first_loaded_call(self, args):
        """A loaded artifact's first outputs against the region's torch ops; a mismatch compiles it again."""
        self.unchecked = False
        want = self.fn(*args)
        try:
            got = self.compiled(*args)
            problem = None if _all_close(got, want) else "outputs differ from its torch ops"
        except Exception as e:
            problem = f"raised {type(e).__name__}: {e}"
        if problem is None:
            return got
        from thunder_batch.compile.cache import warn

        warn(f"compiled fusion region {self.digest}.bin ignored, compiling again: {problem}")
        self.loaded, self.artifact_sha = False, None
        self._compile(args)
        return want

    def _make(self, args) -> None:
        from thunder_batch.compile.provenance import codegen

        key = (self.source, [_meta(a) for a in args], torch.__version__, codegen("cpu"))
        self.digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
        if not self._load():
            self._compile(args)

    def _compile(self, args) -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        try:
            graph = make_fx(self.fn)(*args)
            artifact = torch._inductor.standalone_compile(graph, list(args), dynamic_shapes="from_example_inputs")
        except Exception as e:  # no compiler, an unwritable or full disk for Inductor's files
            fallbacks.report("unfused_region", f"a fusion region could not be compiled ({type(e).__name__}: {e})")
            self.compiled = self.fn
            return
        self.compiled = artifact
        self._save(artifact)

    def _path(self, suffix: str = ".bin") -> Path | None:
        return None if self.artifact_dir is None else self.artifact_dir / f"{self.digest}{suffix}"

    def _load(self) -> bool:
        path = self._path()
        if path is None or not path.exists():
            return False
        from thunder_batch.compile.cache import sha256, warn

        try:
            data, problem = _checked_bytes(path, self._path(".sha256"), self.artifact_sha)
            if problem is None:
                self.compiled = torch._inductor.CompiledArtifact.load(path=str(path), format="binary")
                self.artifact_sha, self.loaded, self.unchecked = sha256(data), True, True
                return True
        except Exception as e:
            problem = f"unloadable ({type(e).__name__}: {e})"
        warn(f"compiled fusion region {path.name} ignored, compiling again: {problem}")
        return False

    def _save(self, artifact) -> None:
        path = self._path()
        if path is None:
            return
        from thunder_batch.compile.cache import sha256, write_atomically

        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            artifact.save(path=str(tmp), format="binary")
            data = tmp.read_bytes()
        except OSError as e:
            fallbacks.report("region_unsaved", f"a compiled fusion region could not be stored ({e.strerror or e})")
            return
        finally:
            tmp.unlink(missing_ok=True)
        digest = sha256(data)  # the hash first: a reader never finds an artifact without its hash
        if write_atomically(self._path(".sha256"), digest.encode()) and write_atomically(path, data):
            self.artifact_sha = digest

    @property
    def stored(self) -> bool:
        """Compiled and its artifact saved: a stored piece can name it."""
        return self.digest is not None and self.artifact_sha is not None

    def recipe(self, ctx_recipe) -> list:
        """How a stored piece gets this region back: its source, how to import its names, the
        compiled artifact's digest and hash (only once `stored`). `ctx_recipe`: trace_export's recipe
        for a context name."""
        ctx = {n: ctx_recipe(n, obj) for n, obj in sorted(self.ctx.items())}
        return ["inductor", self.name, self.source, ctx, self.digest, self.artifact_sha]

    @classmethod
    def from_recipe(cls, recipe: list, resolve_ctx) -> FusedRegion:
        _, name, source, ctx_recipes, digest, artifact_sha = recipe
        ctx = {n: resolve_ctx(r) for n, r in ctx_recipes.items()}
        region = cls(name, source, _function(source, ctx), _artifact_dir.get())
        region.ctx, region.digest, region.artifact_sha = ctx, digest, artifact_sha
        return region


def _function(source: str, ctx: dict):
    namespace = dict(ctx)
    exec(compile(source, "thunder_batch.fused_region", "exec"), namespace)
    return namespace["fused_region"]


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
    """Names of the proxies that alias a tensor some `copy_` writes in place (through views either way)."""
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
    source = torch_trace.python(include_decorators=False)
    ctx = torch_trace.python_ctx()
    region = FusedRegion(name, source, _function(source, ctx), _artifact_dir.get())
    region.ctx = ctx
    return region
