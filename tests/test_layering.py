"""Imports point one way (docs/DESIGN.md, Layout): every `import` statement in the package, those
inside functions included, goes to its own layer or a lower one; none closes a cycle; nothing imports
a command module. Importing `pkg.mod` also imports `pkg` (its __init__ runs), and `from pkg import
mod` imports the submodule, so both count as edges."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "thunder_batch"

# Lowest first. A module's layer is that of its longest listed prefix.
LAYERS = [
    (
        "pure Python",
        ["thunder_batch", "config", "request", "stops", "scheduler", "versions", "detokenize", "chat"]
        + ["fallbacks", "text_encoding", "drafts", "prefix_store", "step_plan", "observe", "intake"]
        + ["param_error", "logit_controls", "sampling_params"],
    ),
    (
        "torch",
        ["_compat", "index_ops", "kv_cache", "moe", "model", "sampler", "program", "checkpoints", "gguf_convert"]
        + ["native", "weights", "quantized", "gguf_load", "gguf_write", "control_rows"],
    ),
    ("thunder", ["compile"]),
    ("runner", ["runner"]),
    ("engine", ["engine"]),
    ("front ends", ["serve", "bench"]),
    ("commands", ["cli"]),
]
PURE_NO_TORCH = [  # DESIGN: pure Python, no torch
    "config",
    "param_error",
    "sampling_params",
    "logit_controls",
    "request",
    "stops",
    "scheduler",
    "prefix_store",
    "drafts",
    "versions",
    "fallbacks",
    "text_encoding",
    "step_plan",
    "observe",
    "intake",
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module (package ones, and external top-level names) that `path` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
    internal = {m for name in found if name.startswith("thunder_batch") for m in _with_parents(name) if m in modules}
    return internal | {name.split(".")[0] for name in found if not name.startswith("thunder_batch")}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {m for m in imports_of(path, modules) if m in modules} - {name} for name, path in modules.items()}


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            full = prefix if prefix == "thunder_batch" else f"thunder_batch.{prefix}"
            if (module == full or module.startswith(full + ".")) and len(full) > best:
                best, rank = len(full), i
    assert rank is not None, f"{module} is in no layer of LAYERS: add it (and to docs/DESIGN.md's layout)"
    return rank


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_point_down_the_layers():
    wrong = [
        f"{src} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]})"
        for src, dsts in import_graph().items()
        for dst in dsts
        if layer_of(dst) > layer_of(src)
    ]
    assert not wrong, "\n".join(wrong)


def test_only_commands_import_commands():
    wrong = [
        f"{src} imports {dst}"
        for src, dsts in import_graph().items()
        if not src.startswith("thunder_batch.cli")
        for dst in dsts
        if dst.startswith("thunder_batch.cli")
    ]
    assert not wrong, "\n".join(wrong)


def test_pure_modules_import_no_torch():
    modules = _modules()
    for name in PURE_NO_TORCH:
        imported = imports_of(modules[f"thunder_batch.{name}"], modules)
        assert not imported & {"torch", "thunder", "litgpt"}, f"thunder_batch.{name} imports {imported}"


def test_only_compile_imports_thunder():
    modules = _modules()
    # _compat's import_thunder() is the one door: it patches torch, then imports thunder.
    allowed = ("thunder_batch.compile", "thunder_batch._compat")
    wrong = [n for n, p in modules.items() if "thunder" in imports_of(p, modules) and not n.startswith(allowed)]
    assert not wrong, wrong


def test_the_front_ends_talk_to_the_engine_only():
    """serve/ and bench/ drive and watch the engine through `Engine` (its observers, counters, probe_step),
    never through its runner or scheduler."""
    graph = import_graph()
    inner = {"thunder_batch.runner", "thunder_batch.scheduler", "thunder_batch.step_plan"}
    wrong = {n: graph[n] & inner for n in graph if n.startswith(("thunder_batch.serve", "thunder_batch.bench"))}
    assert not any(wrong.values()), {n: e for n, e in wrong.items() if e}


def method_replacements(source: str, methods: set[str]) -> list[str]:
    """`obj.name = ...`, `del obj.name` and `setattr(obj, "name", ...)` where `name` is a method of one of the
    package's classes and `obj` is not `self`: code replacing another object's method."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in methods and not _is_self(t.value):
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in methods and not _is_self(node.args[0]):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def package_methods() -> set[str]:
    """Names of the package's methods that no class of it also uses as a data attribute (`self.name = ...`, a
    dataclass field): assigning one on another object can only replace a method."""
    methods, data = set(), set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                methods |= {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                data |= {
                    f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
                }
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                data |= {t.attr for t in targets if isinstance(t, ast.Attribute) and _is_self(t.value)}
    return methods - data - {"__init__", "__call__", "forward"}


def test_no_module_replaces_another_objects_method():
    methods = package_methods()
    found = {n: m for n, p in _modules().items() if (m := method_replacements(p.read_text(encoding="utf-8"), methods))}
    assert not found, found


def test_the_method_replacement_check_finds_one():
    methods = {"run", "schedule"}
    source = "runner.run = timed\nsetattr(scheduler, 'schedule', f)\ndel engine.scheduler.schedule\nself.run = f\n"
    assert len(method_replacements(source, methods)) == 3


def test_the_inference_worker_does_not_load_the_http_side():
    assert "thunder_batch.serve.routes" not in import_graph()["thunder_batch.serve.worker"]


@pytest.mark.parametrize(
    "source, edges",
    [
        (
            "import thunder_batch.compile.cache\n",
            {"thunder_batch", "thunder_batch.compile", "thunder_batch.compile.cache"},
        ),
        (
            "def f():\n    from thunder_batch.compile import cache\n",
            {"thunder_batch", "thunder_batch.compile", "thunder_batch.compile.cache"},
        ),
        ("from thunder_batch.config import EngineConfig\n", {"thunder_batch", "thunder_batch.config"}),
    ],
)
def test_the_walker_counts_function_level_and_submodule_imports(tmp_path, source, edges):
    path = tmp_path / "m.py"
    path.write_text(source)
    assert imports_of(path, _modules()) == edges


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def code_lines(lines: list[str], first: int, last: int, skipped: set[int]) -> int:
    """Lines `first`..`last` (1-based) that hold code: not blank, not a comment, not in `skipped` (docstrings)."""
    return sum(1 for i in range(first, last + 1) if i not in skipped and lines[i - 1].strip()[:1] not in ("", "#"))


def docstring_lines(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = set()
    for node in ast.walk(tree):
        first = node.body[0] if isinstance(node, kinds) and node.body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found |= set(range(first.lineno, first.end_lineno + 1))
    return found


def test_files_and_functions_keep_to_the_house_rule():
    """DESIGN, Layout: files under ~300 lines of code, function bodies under ~40 (docstrings, comments and blank
    lines not counted: they carry the why and the shapes; a signature listing a command's flags not counted)."""
    too_long = []
    for name, path in _modules().items():
        lines = path.read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(lines))
        docs = docstring_lines(tree)
        if (n := code_lines(lines, 1, len(lines), docs)) > 300:
            too_long.append(f"{name}: {n} lines of code")
        for f in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            if (n := code_lines(lines, f.body[0].lineno, f.end_lineno, docs)) > 40:
                too_long.append(f"{name}.{f.name}: {n} lines of code")
    assert not too_long, too_long
