"""What made a stored program, beyond the model and the config: the code, the machine code generator.

- `source_digest()`: the bytes of every package file a stored program can depend on, found by construction:
  the modules the runner imports, directly or not (every `import` statement, those inside functions included,
  but not those for type annotations only), every module of `compile/` (all that touches Thunder), and the
  non-Python files beside them (the native kernels' C++). A comment-only edit counts; no git state is read, so
  a copied package keys on its own files. The front ends (engine, serve, bench, cli) are not imported by the
  runner (tests/test_layering.py), so editing them keeps the cache.
- `codegen(device)`: for CPU programs, what shapes generated machine code: the CPU's ISA flags, the
  C++ compiler Inductor calls and its version, Inductor's settings. A cache shared between machines
  (NFS, an image layer, a CI cache) never loads code built for another ISA or compiler.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent
ROOT_MODULES = ("thunder_batch.runner",)  # owns the step program; what it imports can shape one
WHOLE_PACKAGES = ("thunder_batch.compile",)  # every module, imported or not
DATA_SUFFIXES = (".cpp", ".h")  # sources read by a module beside them (the native kernels' build)


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package at `package`."""
    files = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `path` imports anywhere in it, with the packages above them (their __init__ runs);
    not those under `if TYPE_CHECKING:`, which never run."""
    found: set[str] = set()
    tree = ast.parse(path.read_bytes())
    guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and _is_type_checking(n.test)]
    skipped = {id(node) for guard in guarded for statement in guard.body for node in ast.walk(statement)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    parents = {".".join(name.split(".")[: i + 1]) for name in found for i in range(name.count(".") + 1)}
    return {name for name in parents if name in modules}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def program_files(package: Path = PACKAGE) -> list[Path]:
    """Every file of the package at `package` that a stored program can depend on (see the module docstring)."""
    modules = module_files(package)
    todo = [m for m in modules if m in ROOT_MODULES or m.startswith(WHOLE_PACKAGES)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(imported_modules(modules[name], modules) - seen)
    files = {modules[name] for name in seen}
    folders = {path.parent for path in files}
    files |= {p for folder in folders for p in folder.iterdir() if p.suffix in DATA_SUFFIXES}
    return sorted(files)


def source_digest(package: Path = PACKAGE) -> str:
    """SHA-256 over the relative path and bytes of each of `program_files(package)`."""
    digest = hashlib.sha256()
    for path in program_files(package):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


@functools.cache
def codegen(device_type: str) -> str:
    """What shapes the machine code of compiled programs on this device type (see the module docstring)."""
    if device_type != "cpu":
        return device_type  # CUDA: the device's name and capability are in the key's device_kind
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    from thunder_batch.native.build import cpu_flags

    compiler = cpp_builder.get_cpp_compiler()
    try:
        compiler_version = cpp_builder.get_compiler_version_info(compiler)
    except Exception as e:  # no compiler: nothing compiles, so nothing from one may load
        compiler_version = f"unavailable: {type(e).__name__}"
    parts = [
        " ".join(sorted(cpu_flags())),
        str(cpu_vec_isa.pick_vec_isa()),
        compiler,
        compiler_version,
        hashlib.sha256(repr(sorted(config.save_config_portable().items())).encode()).hexdigest(),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
