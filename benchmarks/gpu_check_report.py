"""The GPU check's JSON report: stages with timings and errors, the time budget (measured from the first
traced shape), a hard deadline that still writes a complete JSON, and the verdict.

The verdict cannot pass by skipping: it is FAIL unless every parity check the device can run (REQUIRED)
ran and matched. On CPU the CUDA-only stages are listed under `needs_cuda`, not counted as skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

# Parity checks that must have run and matched for a PASS, per device.
REQUIRED = {
    "cpu": ("eager_vs_litgpt_generate_fn", "thunder_vs_eager"),
    "cuda": ("eager_vs_litgpt_generate_fn", "thunder_vs_eager", "thunder-cudagraphs_vs_eager"),
}


def environment(device: str) -> dict:
    """Versions tested, the accelerator, and which Thunder executors are usable (and why not)."""
    from thunder_batch.compile.executors import executor_availability
    from thunder_batch.compile.trace_speedups import unverified_sources
    from thunder_batch.versions import package_versions

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **package_versions(("lightning-thunder", "litgpt", "triton", "nvfuser", "transformers"), "not installed"),
        "device": device,
    }
    if device == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(),
            devices=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            capability=".".join(map(str, torch.cuda.get_device_capability())),
        )
    env["executors"] = {name: why or "available" for name, why in executor_availability().items()}
    changed = unverified_sources()
    env["trace_speedups_sources"] = "verified" if not changed else "differ: " + ", ".join(changed)
    return env


class Report:
    """Collects results into one JSON file, rewritten after every stage."""

    def __init__(self, path: Path, budget_s: float, device: str) -> None:
        self.path, self.budget_s, self.device, self.start = path, budget_s, device, time.perf_counter()
        self._compile_per_shape: float | None = None  # None until the first traced shape is measured
        self._lock = threading.RLock()
        self.current = "start"
        self._deadline: threading.Timer | None = None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"stages": [], "errors": [], "skipped": [], "needs_cuda": [], "checks": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def save(self) -> None:
        with self._lock:
            self.data["elapsed_s"] = round(self.elapsed(), 1)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n", encoding="utf-8")
            tmp.replace(self.path)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Time a stage; an exception is recorded (with its traceback tail) and the run goes on."""
        print(f"[{self.elapsed():6.1f} s] {name} ...", file=sys.stderr, flush=True)
        start, self.current = time.perf_counter(), name
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a failed stage is a result, not the end of the check
            tail = traceback.format_exc().strip().splitlines()[-12:]
            self.data["errors"].append({"stage": name, "error": f"{type(e).__name__}: {e}", "traceback": tail})
            print(f"    FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self.data["stages"].append({"stage": name, "seconds": round(time.perf_counter() - start, 2)})
            self.save()

    def failed(self, prefix: str) -> bool:
        return any(e["stage"].startswith(prefix) for e in self.data["errors"])

    def needs_cuda(self, what: str) -> None:
        """A stage the CPU dry run cannot run: named in the JSON, not a skip."""
        self.data["needs_cuda"].append(what)

    def check(self, name: str, result: dict) -> None:
        self.data["checks"][name] = result

    def observe_compile(self, seconds_per_shape: dict) -> None:
        """Seconds per traced shape, measured: the estimate becomes the slowest seen so far."""
        if seconds_per_shape:
            slowest = max(seconds_per_shape.values())
            self._compile_per_shape = max(self._compile_per_shape or 0.0, slowest)
            self.data["compile_s_per_shape_estimate"] = round(self._compile_per_shape, 2)

    def compile_estimate(self, shapes: int) -> float:
        """Seconds to trace `shapes` shapes; 0 before any was measured (the first compiled stage runs)."""
        return shapes * (self._compile_per_shape or 0.0)

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
        checks = self.data["checks"]
        if self.data["errors"]:
            return False, f"{len(self.data['errors'])} stage(s) raised: " + ", ".join(
                e["stage"] for e in self.data["errors"]
            )
        failed = [name for name, check in checks.items() if not check["match"]]
        if failed:
            return False, "parity failed: " + ", ".join(failed)
        missing = [name for name in REQUIRED[self.device] if name not in checks]
        if missing:
            return False, "required parity did not run: " + ", ".join(missing)
        status = "complete" if not self.data["skipped"] else f"partial: {len(self.data['skipped'])} item(s) skipped"
        return True, f"parity passed ({len(checks)} checks: {', '.join(checks)}); {status}"

    def finish(self) -> int:
        if self._deadline is not None and threading.current_thread() is not self._deadline:
            self._deadline.cancel()
        with self._lock:
            ok, why = self.verdict()
            self.data["ok"], self.data["verdict"] = ok, why
            self.save()
        print(self.summary(ok, why), flush=True)
        return 0 if ok else 1

    def start_deadline(self, seconds: float) -> None:
        """At `seconds`, record the stage still running as an error, write the verdict and exit: the JSON
        is complete even when a stage overruns (a stage cannot be interrupted cleanly from outside)."""

        def expire() -> None:
            with self._lock:
                self.data["errors"].append(
                    {"stage": self.current, "error": f"hard deadline: still running at {seconds:.0f} s"}
                )
                status = self.finish()
            os._exit(status)

        self._deadline = threading.Timer(seconds, expire)
        self._deadline.daemon = True
        self._deadline.start()

    def summary(self, ok: bool, why: str) -> str:
        lines = [f"GPU CHECK: {'PASS' if ok else 'FAIL'} ({why}); {self.elapsed():.0f} s; JSON: {self.path}"]
        env = self.data.get("environment", {})
        keys = ("torch", "lightning-thunder", "litgpt", "nvfuser", "python", "gpu")
        lines.append("tested: " + ", ".join(f"{k} {env[k]}" for k in keys if k in env))
        lines.append(f"model: {self.data.get('model', {}).get('weights', 'not loaded')}")
        for name, check in self.data["checks"].items():
            lines.append(f"  parity {name}: {'match' if check['match'] else check['first_mismatch']}")
        for name, line in self.data.get("fusions", {}).get("lines", {}).items():
            lines.append(f"  fusions {name}: {line}")
        lines.append(f"  {'mode':<24}{'batch':>6}{'compile s':>11}{'ms/step':>10}{'tokens/s':>11}{'HBM %':>7}")
        for row in self.data.get("benchmark", {}).get("rows", []):
            hbm = row.get("hbm_share")
            lines.append(
                f"  {row['mode']:<24}{row['batch_size']:>6}{row['compile_s']:>11.1f}"
                f"{row['ms_per_step']:>10.2f}{row['tokens_per_s']:>11.1f}{'' if hbm is None else f'{100 * hbm:.0f}':>7}"
            )
        lines += [f"  needs CUDA (not run here): {what}" for what in self.data["needs_cuda"]]
        lines += [f"  skipped {s['what']}: {s['reason']}" for s in self.data["skipped"]]
        lines += [f"  ERROR in {e['stage']}: {e['error']}" for e in self.data["errors"]]
        return "\n".join(lines)
