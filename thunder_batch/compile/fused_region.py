"""A fusion region of the "inductor" executor (compile.fusion): compiled by Inductor on first call or
loaded from the compile cache root, checked, and called directly (no Dynamo, no guards).

A compiled artifact is saved as `<root>/inductor/<digest>.bin` with its SHA-256 beside it
(`<digest>.sha256`, written at save time). The digest covers the region's source, its inputs' shapes,
strides and dtypes, torch's version and what shapes machine code on this CPU (provenance.codegen: ISA
flags, compiler, Inductor's settings). Loading needs a safe file whose hash matches; its first outputs
must match the region's own torch ops. A region that
cannot be compiled (no compiler, unwritable disk) runs its torch ops, reported once (fallbacks).
Inductor's own caches live under `<root>/inductor-cache`.
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
    is probed first, in Inductor's default place (seconds of test builds once per machine, not per root:
    benchmarks/RESULTS.md, "The default executors in one `thunder-batch bench` run, quiet machine")."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        cpu_vec_isa.pick_vec_isa()  # probed once per process, its test builds kept where every root finds them
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path.absolute())


def _checked_bytes(path: Path, hash_path: Path) -> tuple[bytes, str | None]:
    """(the artifact's bytes, what is wrong with them or None): a safe file whose SHA-256 is the one
    written beside it at save time. (Not the one a stored piece recorded: an artifact compiled again
    after a failed check replaces both files, and the piece that names the region stays valid.)"""
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
    return data, problem


def _all_close(got, want, close=None) -> bool:
    """Every output of `got` against `want`'s, by `close` (default: `_close`)."""
    got, want, close = _tensors(got), _tensors(want), close or _close
    return len(got) == len(want) and all(close(g, w) for g, w in zip(got, want))


def _tensors(value) -> list:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _close(got, want) -> bool:
    """Inductor computes a region's elementwise chain in float32 and rounds once; torch's ops round each
    step: for 16-bit floats they differ by a few units in the last place."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return got == want
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    tol = 1e-4 if got.dtype == torch.float32 or got.dtype == torch.float64 else 3e-2
    return torch.allclose(got, want, rtol=tol, atol=tol)


def _same_outputs(got, want, args) -> bool:
    """Equal tensors with equal layouts, views of an input exactly where `want`'s are (the same view)."""
    inputs = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
    return _all_close(got, want, lambda g, w: _same(g, w, inputs))


def _same(got, want, inputs: set) -> bool:
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return got == want
    # The stride of a size-1 dimension is never used to address memory (a view may carry another)
    strides = [(a, b) for a, b, n in zip(got.stride(), want.stride(), want.shape) if n != 1]
    if (got.shape, got.dtype) != (want.shape, want.dtype) or any(a != b for a, b in strides):
        return False
    if _storage(want) in inputs:
        return got.data_ptr() == want.data_ptr()
    return _storage(got) not in inputs and torch.equal(got, want)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _meta(t) -> list:
    return [list(t.shape), list(t.stride()), str(t.dtype), t.device.type] if isinstance(t, torch.Tensor) else [repr(t)]


class FusedRegion:
    """A region's torch function, compiled by Inductor on first call (or loaded) and called directly.

    source: the region as Python (Thunder's torch-executor trace of it); fn: that source as a function.
    A compiled artifact is stored as `<digest>.bin` with its SHA-256 in `<digest>.sha256`, written at
    save time: a loaded artifact must match it, and
    its first outputs must match its torch ops. A region that cannot be compiled runs its torch ops.
    """

    def __init__(self, name: str, source: str, fn, artifact_dir: Path | None) -> None:
        self.name, self.source, self.fn, self.artifact_dir = name, source, fn, artifact_dir
        self.compiled = None
        self.call = None  # what a call runs once the first one chose (`_first_call`)
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
            return self.call(*args) if self.call is not None else self._first_call(args)
        except AssertionError:  # inputs with other strides than the compiled ones: run the torch ops
            fallbacks.report("region_strides", f"fusion region {self.name} called with other strides: torch ops ran")
            return self.fn(*args)

    def _first_call(self, args):
        """From now on, call the generated code without AOTAutograd's wrappers if that gives the wrapped
        call's outputs here (values, shapes, strides, and which alias an input): ~half of the call's host time."""
        from thunder_batch._compat import inductor_graph_call

        want = self.compiled(*args)
        direct = inductor_graph_call(self.compiled)
        try:
            same = direct is not None and _same_outputs(direct(*args), want, args)
        except Exception:  # an argument list the generated code does not take as is
            same = False
        self.call = direct if same else self.compiled
        return want

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
        self.loaded, self.artifact_sha, self.call = False, None, None
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
            data, problem = _checked_bytes(path, self._path(".sha256"))
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
        else:
            fallbacks.report("region_unsaved", "a compiled fusion region could not be stored (see the warning above)")

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


def make_region(name: str, source: str, ctx: dict) -> FusedRegion:
    """A region from its torch-executor source and the names it uses; artifacts in the current `artifacts_in`."""
    region = FusedRegion(name, source, _function(source, ctx), _artifact_dir.get())
    region.ctx = ctx
    return region
