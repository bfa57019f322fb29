"""A `thunder-batch serve` process on 127.0.0.1 for tests: start, wait healthy, clients, stop."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key"
STARTUP_TIMEOUT_S = 600  # first run converts the default model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, log_path: Path, checkpoint: Path, *args: str, compile: str = "eager", host: str | None = None):
        """host: passed as --host (the default binds 127.0.0.1); the URL names it ([::1] for IPv6)."""
        self.port, self.log_path = free_port(), log_path
        name = host or "127.0.0.1"
        self.url = f"http://[{name}]:{self.port}" if ":" in name else f"http://{name}:{self.port}"
        args = (*args, "--host", host) if host else args
        cmd = [
            sys.executable,
            "-m",
            "thunder_batch.cli",
            "serve",
            "--checkpoint_dir",
            str(checkpoint),
            "--compile",
            compile,
            "--port",
            str(self.port),
            "--log_level",
            "warning",
            *args,
        ]
        # One torch thread: this 2-core machine is shared, and the offline oracle uses one too.
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).text == "ok":  # every worker is up
                    return
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                child.kill()
            self.proc.kill()
            raise

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=600)

    def post(self, path: str, content: bytes, key: str | None = KEY, timeout: float = 120) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout)

    def stats(self) -> dict:
        """Every worker's counters, summed (`workers`: each worker's own), and the requests in flight."""
        return httpx.get(self.url + "/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=120).json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=30)

    def wait_all_free(self, timeout: float = 60) -> dict:
        """Wait until no slot, engine queue entry or request in flight is left on any worker."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats())["running"] or stats["waiting"] or stats["in_flight"] or stats.get("requests"):
            assert time.monotonic() < deadline, stats
            time.sleep(0.5)
        return stats

    def wait_healthy(self, timeout: float = 120) -> float:
        """Seconds until /health answers "ok" again (every worker serving)."""
        start = time.monotonic()
        while self.health().text != "ok":
            assert time.monotonic() - start < timeout, self.health().text
            time.sleep(0.2)
        return time.monotonic() - start

    def family(self) -> list[psutil.Process]:
        main = psutil.Process(self.proc.pid)
        return [main, *main.children(recursive=True)]


def cut_checkpoint(source: Path, root: Path, n_layer: int = 2) -> Path:
    """`source`'s embeddings, first `n_layer` blocks, final norm and tokenizer, in root/<source's name> (litgpt
    picks the tokenizer's BOS handling and the chat template from that name)."""
    import torch
    from litgpt import Config
    from litgpt.utils import save_config

    out = root / source.name
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    save_config(Config.from_file(source / "model_config.yaml", n_layer=n_layer), out)
    state = torch.load(source / "lit_model.pth", mmap=True, weights_only=True)
    blocks = {str(i) for i in range(n_layer)}
    keep = {k: v.clone() for k, v in state.items() if not k.startswith("transformer.h.") or k.split(".")[2] in blocks}
    torch.save(keep, out / "lit_model.pth")
    return out
