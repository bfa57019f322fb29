"""The GPU check's JSON report: stages with timings and errors, the time budget, the final verdict."""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch


def environment(device: str) -> dict:
    """Versions tested, the accelerator, and which Thunder executors are usable (and why not)."""
    from thunder_batch.compile.executors import executor_availability
    from thunder_batch.versions import package_versions

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **package_versions(("lightning-thunder", "litgpt", "triton"), "not installed"),
        "device": device,
    }
    if device == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
        )
    env["executors"] = {name: why or "available" for name, why in executor_availability().items()}
    return env


class Report:
    """Collects results into one JSON file, rewritten after every stage."""

    def __init__(self, path: Path, budget_s: float, compile_estimate_s: float) -> None:
        self.path, self.budget_s, self.start = path, budget_s, time.perf_counter()
        self._compile_per_shape = compile_estimate_s  # replaced by the slowest shape measured
        self._measured = False
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"stages": [], "errors": [], "skipped": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n", encoding="utf-8")
        tmp.replace(self.path)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time a stage; an exception is recorded (with its traceback tail) and the run goes on."""
        print(f"[{self.elapsed():6.1f} s] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a failed stage is a result, not the end of the check
            tail = traceback.format_exc().strip().splitlines()[-12:]
            self.data["errors"].append({"stage": name, "error": f"{type(e).__name__}: {e}", "traceback": tail})
            print(f"    FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self.data["stages"].append({"stage": name, "seconds": round(time.perf_counter() - start, 2)})
            self.save()

    def observe_compile(self, seconds_per_shape: dict) -> None:
        if seconds_per_shape:
            slowest = max(seconds_per_shape.values())
            self._compile_per_shape = max(self._compile_per_shape, slowest) if self._measured else slowest
            self._measured = True

    def compile_estimate(self) -> float:
        return self._compile_per_shape

    def has_time(self, needed_s: float, what: str) -> bool:
        left = self.budget_s - self.elapsed()
        if left >= needed_s:
            return True
        self.data["skipped"].append(
            {"what": what, "reason": f"time budget: {left:.0f} s left, about {needed_s:.0f} s needed"}
        )
        print(f"[{self.elapsed():6.1f} s] skipped {what}: budget", file=sys.stderr, flush=True)
        return False

    def verdict(self) -> tuple[bool, str]:
        checks = self.data.get("parity", {}).get("checks", {})
        failed = [name for name, check in checks.items() if not check["match"]]
        if self.data["errors"]:
            return False, f"{len(self.data['errors'])} stage(s) raised"
        if failed:
            return False, "parity failed: " + ", ".join(failed)
        if not checks:
            return False, "no parity check ran"
        status = "complete" if not self.data["skipped"] else f"partial: {len(self.data['skipped'])} item(s) skipped"
        return True, f"parity passed ({len(checks)} checks); {status}"

    def finish(self) -> int:
        ok, why = self.verdict()
        self.data["ok"], self.data["verdict"] = ok, why
        self.save()
        print(self.summary(ok, why))
        return 0 if ok else 1

    def summary(self, ok: bool, why: str) -> str:
        lines = [f"GPU CHECK: {'PASS' if ok else 'FAIL'} ({why}); {self.elapsed():.0f} s; JSON: {self.path}"]
        env = self.data.get("environment", {})
        lines.append(
            "tested: "
            + ", ".join(f"{k} {env[k]}" for k in ("torch", "lightning-thunder", "litgpt", "python", "gpu") if k in env)
        )
        for name, check in self.data.get("parity", {}).get("checks", {}).items():
            lines.append(f"  parity {name}: {'match' if check['match'] else check['first_mismatch']}")
        lines.append(f"  {'mode':<20}{'batch':>6}{'compile s':>11}{'ms/step':>10}{'tokens/s':>11}")
        for row in self.data.get("benchmark", {}).get("rows", []):
            lines.append(
                f"  {row['mode']:<20}{row['batch_size']:>6}{row['compile_s']:>11.1f}"
                f"{row['ms_per_step']:>10.2f}{row['tokens_per_s']:>11.1f}"
            )
        lines += [f"  skipped {s['what']}: {s['reason']}" for s in self.data["skipped"]]
        lines += [f"  ERROR in {e['stage']}: {e['error']}" for e in self.data["errors"]]
        return "\n".join(lines)
