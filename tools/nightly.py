"""Run the Thunder regression tests (`pytest -m regression`) and print what was tested and the verdict.

Used by `make test-nightly` in .venv-nightly (the newest lightning-thunder pre-release, everything
else at the project's pins), and usable in any environment:

    python tools/nightly.py [--out nightly_out] [extra pytest args...]

Prints the versions tested (python, torch, lightning-thunder against its pin, litgpt), streams
pytest, then a summary block; writes <out>/summary.json and <out>/junit.xml. Exit status: 0 when
every selected test passed or skipped, else non-zero (pytest's status; 1 when nothing was collected).
Reads versions from package metadata (thunder_batch.versions): nothing here imports thunder. The tests get
a fresh compile cache (THUNDER_BATCH_CACHE_DIR, unless set), so the Thunder under test traces every program.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, installed or not

from thunder_batch.versions import package_versions  # noqa: E402  (imports no torch or thunder)

PACKAGES = ("torch", "lightning-thunder", "litgpt")


def pinned_thunder(pyproject: Path = ROOT / "pyproject.toml") -> str | None:
    """The lightning-thunder version pyproject.toml pins (None if it pins none)."""
    match = re.search(r'"lightning-thunder==([^"]+)"', pyproject.read_text(encoding="utf-8"))
    return match.group(1) if match else None


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    found.update(package_versions(PACKAGES, "not installed"))
    found["lightning-thunder (pinned)"] = pinned_thunder() or "none"
    return found


def version_line(found: dict[str, str]) -> str:
    thunder, pin = found["lightning-thunder"], found["lightning-thunder (pinned)"]
    note = "the pinned version" if thunder == pin else f"pinned: {pin}"
    return (
        f"lightning-thunder {thunder} ({note}), torch {found['torch']}, litgpt {found['litgpt']}, "
        f"python {found['python']}"
    )


def junit_counts(path: Path) -> dict:
    """passed/failed/errors/skipped and the ids of failing tests, from pytest's JUnit XML."""
    if not path.is_file():
        return dict(passed=0, failed=0, errors=0, skipped=0, failing=[])
    suites = ET.parse(path).getroot().iter("testsuite")
    counts = dict(passed=0, failed=0, errors=0, skipped=0, failing=[])
    for suite in suites:
        for case in suite.iter("testcase"):
            test_id = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
                counts["failing"].append(test_id)
            elif "error" in kinds:
                counts["errors"] += 1
                counts["failing"].append(test_id)
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts


def run_pytest(out: Path, extra: list[str]) -> int:
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-m", "regression", "-q", f"--junitxml={junit}", *extra]
    # A compile cache of its own: every step program is traced by the Thunder under test.
    env = dict(os.environ)
    env.setdefault("THUNDER_BATCH_CACHE_DIR", tempfile.mkdtemp(prefix="nightly_compile_cache_"))
    print(f"$ THUNDER_BATCH_CACHE_DIR={env['THUNDER_BATCH_CACHE_DIR']} " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


def verdict(status: int, counts: dict) -> tuple[bool, str]:
    if status == 5:
        return False, "no regression tests were collected"
    ok = status == 0 and counts["failed"] == 0 and counts["errors"] == 0
    return ok, "all regression tests passed" if ok else f"pytest exited with status {status}"


def summary_block(found: dict, counts: dict, ok: bool, why: str, seconds: float) -> str:
    lines = [
        "",
        "=" * 78,
        f"NIGHTLY THUNDER REGRESSION: {'PASS' if ok else 'FAIL'} ({why})",
        f"tested: {version_line(found)}",
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped in {seconds:.0f} s",
    ]
    lines += [f"  FAILED {test_id}" for test_id in counts["failing"]]
    lines.append("=" * 78)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "nightly_out", help="where summary.json goes")
    args, extra = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    found = versions()
    print(f"nightly: testing {version_line(found)}", flush=True)
    start = time.time()
    status = run_pytest(args.out, extra)
    counts = junit_counts(args.out / "junit.xml")
    ok, why = verdict(status, counts)
    seconds = time.time() - start
    report = dict(ok=ok, verdict=why, pytest_status=status, seconds=round(seconds, 1), versions=found, **counts)
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    block = summary_block(found, counts, ok, why, seconds)
    print(block)
    if os.environ.get("GITHUB_STEP_SUMMARY"):  # shown on the workflow run's page
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
            f.write("```\n" + block.strip() + "\n```\n")
    return 0 if ok else (status or 1)


if __name__ == "__main__":
    sys.exit(main())
