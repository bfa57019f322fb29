"""The maintainer tools: the nightly summary (tools/nightly.py) and the GPU check's CPU mode
(benchmarks/gpu_check.py), run here without tracing (its compiled stages fall outside a small budget)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def nightly():
    return load("tools/nightly.py", "nightly_tool")


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_ok" time="1"/>
<testcase classname="tests.test_a" name="test_bad" time="1"><failure message="x">boom</failure></testcase>
<testcase classname="tests.test_b" name="test_gpu" time="0"><skipped message="needs an NVIDIA GPU"/></testcase>
<testcase classname="tests.test_b" name="test_err" time="0"><error message="fixture">e</error></testcase>
</testsuite></testsuites>"""


def test_nightly_counts_and_names_failures(nightly, tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    counts = nightly.junit_counts(tmp_path / "junit.xml")
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (1, 1, 1, 1)
    assert counts["failing"] == ["tests.test_a::test_bad", "tests.test_b::test_err"]
    ok, why = nightly.verdict(1, counts)
    assert not ok and "status 1" in why
    found = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "lightning-thunder": "0.2.8.dev1",
        "litgpt": "0.5.13",
        "lightning-thunder (pinned)": "0.2.7.dev20260201",
    }
    block = nightly.summary_block(found, counts, ok, why, 12.0)
    assert "NIGHTLY THUNDER REGRESSION: FAIL" in block and "FAILED tests.test_a::test_bad" in block
    assert "lightning-thunder 0.2.8.dev1 (pinned: 0.2.7.dev20260201), torch 2.13.0" in block


def test_nightly_with_nothing_collected_fails(nightly, tmp_path):
    counts = nightly.junit_counts(tmp_path / "missing.xml")
    assert nightly.verdict(5, counts) == (False, "no regression tests were collected")
    assert nightly.verdict(0, dict(counts, passed=3))[0]
    assert nightly.pinned_thunder() is not None  # pyproject.toml pins lightning-thunder


def test_gpu_check_cpu_mode_without_tracing(tmp_path, monkeypatch):
    """Eager parity vs litgpt's generate_fn on a 1-layer model of the default config; the compiled
    stages do not fit the 5 s budget and are recorded as skipped, with the reason."""
    monkeypatch.setenv("THUNDER_BATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    gpu_check = load("benchmarks/gpu_check.py", "gpu_check")
    status = gpu_check.main(
        ["--device", "cpu", "--layers", "1", "--batches", "1", "--budget-s", "5", "--out", str(tmp_path)]
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["model"]["weights"].startswith("random, same config") and report["model"]["layers"] == 1
    assert report["environment"]["executors"]["torch"] == "available"
    assert report["parity"]["checks"]["eager_vs_litgpt_generate_fn"]["match"], report["parity"]
    assert report["errors"] == []
    assert any(s["what"].startswith("parity thunder") and "time budget" in s["reason"] for s in report["skipped"])
    assert status == 0 and report["ok"] and "partial" in report["verdict"]
