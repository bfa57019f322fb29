"""The compile cache key covers every line of code that shapes a stored program, by construction
(compile/provenance.py): the bytes of the files the runner imports and of every compile module, read
from the package that runs (a copy keys on its own files), and what shapes machine code on this CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from thunder_batch.compile import provenance

TESTS_DIR = Path(__file__).parent


def copy_package(tmp_path: Path) -> Path:
    """A copy of the package under `tmp_path`/pkg; returns the copy's package dir."""
    target = tmp_path / "pkg" / "thunder_batch"
    shutil.copytree(provenance.PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def edit_comment(path: Path) -> None:
    path.write_text(path.read_text(encoding="utf-8") + "\n# an edit that changes no behaviour\n", encoding="utf-8")


def test_program_files_are_the_runners_imports_and_every_compile_module():
    names = {str(p.relative_to(provenance.PACKAGE)) for p in provenance.program_files()}
    compile_modules = {f"compile/{p.name}" for p in (provenance.PACKAGE / "compile").glob("*.py")}
    assert compile_modules <= names
    assert {"model.py", "program.py", "sampler.py", "kv_cache.py", "moe.py", "config.py", "_compat.py"} <= names
    assert {"runner.py", "native/packed_linear.cpp", "native/build.py"} <= names
    assert not any(n.startswith(("serve/", "bench/", "cli/")) or n == "engine.py" for n in names)
    # Scheduling shapes no program: the runner shares only the plan types with it (step_plan.py), whose
    # annotation-only import of Request (under TYPE_CHECKING) never runs.
    assert "step_plan.py" in names
    assert not names & {"scheduler.py", "request.py", "prefix_store.py", "drafts.py"}


def test_an_import_for_annotations_only_is_no_program_file(tmp_path):
    copy = copy_package(tmp_path)
    module = copy / "step_plan.py"
    text = module.read_text(encoding="utf-8")
    assert "if TYPE_CHECKING:" in text
    names = lambda: {p.name for p in provenance.program_files(copy)}  # noqa: E731
    assert "request.py" not in names()
    module.write_text(text.replace("if TYPE_CHECKING:", "if True:"), encoding="utf-8")
    assert "request.py" in names()


def test_a_comment_in_any_program_file_changes_the_digest_of_a_copy(tmp_path):
    copy = copy_package(tmp_path)
    assert provenance.source_digest(copy) == provenance.source_digest()  # a copy keys on its own bytes
    files = provenance.program_files(copy)
    for path in files:
        original = path.read_bytes()
        edit_comment(path)
        assert provenance.source_digest(copy) != provenance.source_digest(), path
        path.write_bytes(original)
    edit_comment(copy / "serve" / "routes.py")  # the server does not shape programs
    assert provenance.source_digest(copy) == provenance.source_digest()


def test_codegen_follows_the_cpu_flags(monkeypatch):
    from thunder_batch.native import build

    provenance.codegen.cache_clear()
    here = provenance.codegen("cpu")
    monkeypatch.setattr(build, "cpu_flags", lambda: {"sse2", "avx2"})
    provenance.codegen.cache_clear()
    try:
        assert provenance.codegen("cpu") != here
    finally:
        monkeypatch.undo()
        provenance.codegen.cache_clear()
    assert provenance.codegen("cpu") == here


WARM_START = """
    import json, sys, warnings
    sys.path.insert(1, {tests!r})
    import thunder_batch
    assert thunder_batch.__file__.startswith({package!r}), thunder_batch.__file__
    from helpers import use_defaults_without_fusion
    use_defaults_without_fusion()
    from test_compile_cache import make_engine, outputs, PROMPTS, PARAMS
    engine = make_engine({root!r})
    results = engine.generate(PROMPTS, PARAMS)
    print(json.dumps(dict(outputs=outputs(results), stats=engine.stats())))
"""


def warm_start(package: Path, root: Path) -> dict:
    """One engine run from the package at `package` (first on PYTHONPATH), compile cache at `root`."""
    script = textwrap.dedent(WARM_START.format(tests=str(TESTS_DIR), package=str(package), root=str(root)))
    env = dict(os.environ, PYTHONPATH=str(package.parent))
    run = dict(capture_output=True, text=True, timeout=600, env=env, cwd=package.parent)  # not this checkout
    proc = subprocess.run([sys.executable, "-c", script], **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("edited", ["compile/layered.py", "model.py"])
def test_an_edited_copy_traces_afresh_and_an_unedited_one_loads(tmp_path, edited):
    copy, root = copy_package(tmp_path), tmp_path / "cache"
    cold = warm_start(copy, root)
    assert cold["stats"]["traced"] > 0
    warm = warm_start(copy, root)
    assert warm["stats"]["traced"] == 0 and warm["stats"]["disk_cache_hits"] > 0
    assert warm["outputs"] == cold["outputs"]
    edit_comment(copy / edited)
    edited_run = warm_start(copy, root)
    assert edited_run["stats"]["disk_cache_hits"] == 0 and edited_run["stats"]["traced"] > 0
