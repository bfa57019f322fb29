"""The maintainer tools: the nightly summary (tools/nightly.py) and the GPU check's CPU mode
(benchmarks/gpu_check.py): its CPU dry run, its verdict, budget and deadline."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
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


def test_gpu_check_cpu_dry_run(tmp_path):
    """`GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh` as `make test` runs it: every stage that does
    not need CUDA runs (Thunder parity traced on a 1-layer model of the default config) and matches, the
    stages that need CUDA are named, and the run exits 0."""
    env = dict(os.environ, GPU_CHECK_DEVICE="cpu", PYTHON=sys.executable, GPU_CHECK_WHEEL_DIRS="", OUT=str(tmp_path))
    env["THUNDER_BATCH_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0 and report["ok"], done.stdout + done.stderr[-3000:]
    assert "GPU CHECK: PASS" in done.stdout and report["errors"] == [] and report["skipped"] == []
    assert report["model"]["weights"].startswith("random (seed 0), same config") and report["model"]["layers"] == 1
    checks = report["checks"]
    assert set(checks) == {"thunder_vs_eager", "eager_vs_litgpt_generate_fn"} and all(
        c["match"] for c in checks.values()
    )
    assert report["parity"]["step_shapes"] == 3 and len(report["parity"]["compile_s"]["thunder"]) == 3
    assert (
        report["parity"]["thunder_stats"]["traced"] > 0 and report["parity"]["thunder_stats"]["trace_speedups"] == "on"
    )
    assert report["compile_s_per_shape_estimate"] > 0  # measured, not assumed
    needs = " | ".join(report["needs_cuda"])
    assert "CUDA graph capture" in needs and "thunder-cudagraphs vs eager" in needs and "KV write" in needs
    assert "pytest -m cuda" in needs  # the suite's CUDA tests: a stage of the check on a GPU
    modes = {row["mode"] for row in report["benchmark"]["rows"]}
    assert {"eager", "thunder"} <= modes and all(row["ms_per_step"] > 0 for row in report["benchmark"]["rows"])
    assert report["fusions"]["default"]["kv_write_unfused"]  # the detector finds the KV write in the traces


@pytest.fixture
def report_cls():
    return load("benchmarks/gpu_check_report.py", "gpu_check_report").Report


def with_checks(report, *names, match=True):
    for name in names:
        report.check(name, {"match": match, "first_mismatch": None if match else {"request": 0}})
    return report


EAGER, THUNDER, GRAPHS = "eager_vs_litgpt_generate_fn", "thunder_vs_eager", "thunder-cudagraphs_vs_eager"


def test_gpu_check_verdict_fails_unless_thunder_and_cuda_graph_parity_ran(report_cls, tmp_path):
    def verdict(device, *names, match=True):
        return with_checks(report_cls(tmp_path / "r.json", 100, device), *names, match=match).verdict()

    assert verdict("cuda", EAGER) == (False, f"required parity did not run: {THUNDER}, {GRAPHS}")
    assert verdict("cuda", EAGER, THUNDER) == (False, f"required parity did not run: {GRAPHS}")
    assert verdict("cuda", EAGER, THUNDER, GRAPHS)[0] and verdict("cpu", EAGER, THUNDER)[0]
    assert verdict("cpu", EAGER) == (False, f"required parity did not run: {THUNDER}")
    assert verdict("cuda", EAGER, THUNDER, GRAPHS, match=False) == (
        False,
        f"parity failed: {EAGER}, {THUNDER}, {GRAPHS}",
    )
    skipped = with_checks(report_cls(tmp_path / "r.json", 0, "cpu"), EAGER, THUNDER)
    assert not skipped.has_time(1, "benchmark thunder batch 8")
    assert skipped.verdict() == (True, f"parity passed (2 checks: {EAGER}, {THUNDER}); partial: 1 item(s) skipped")
    with skipped.stage("benchmark: thunder, batch 8"):
        raise RuntimeError("boom")
    assert skipped.verdict() == (False, "1 stage(s) raised: benchmark: thunder, batch 8")


def test_gpu_check_budget_comes_from_the_first_measured_shape(report_cls, tmp_path):
    report = report_cls(tmp_path / "r.json", 100, "cuda")
    assert report.compile_estimate(2) == 0 and report.has_time(report.compile_estimate(2), "parity thunder")
    report.observe_compile({"decode": 30.0, "2x16 prefill": 40.0})
    assert report.compile_estimate(2) == 80.0 and not report.has_time(report.compile_estimate(3), "parity cg")
    report.observe_compile({"decode": 10.0})  # a faster (cached) shape does not lower the estimate
    assert report.compile_estimate(1) == 40.0
    assert report.data["skipped"] == [{"what": "parity cg", "reason": report.data["skipped"][0]["reason"]}]


def test_gpu_check_deadline_writes_a_complete_json(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); from pathlib import Path; "
        "from gpu_check_report import Report; r = Report(Path(sys.argv[1]), 100, 'cuda'); "
        "r.start_deadline(0.5)\nwith r.stage('parity: thunder vs eager'): time.sleep(30)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert done.returncode == 1 and report["ok"] is False and "GPU CHECK: FAIL" in done.stdout
    assert report["errors"] == [{"stage": "parity: thunder vs eager", "error": "hard deadline: still running at 0 s"}]
