"""A load test of `thunder-batch serve` as clients no one here wrote would drive it.

Starts a server (or uses --url), learns each prompt's greedy answer alone, then runs closed-loop
clients until --requests are done: 10% cancel mid-stream, 10% give up after 0.5 s, 10% send malformed
bodies, the rest ask greedy completions (half streamed) and check each answer against that prompt's
answer alone. Halfway through, one worker is killed (SIGKILL). Reports the outcomes, any 5xx other
than the killed worker's (`worker_died`), hangs (no answer within --hang_s), answers that differ from
the request alone, and the server's resident memory before and after. On the first hang, every server
process's Python stacks are printed (py-spy, when it is on PATH).

    python benchmarks/soak.py --requests 2000 --clients 24 -- --batch_size 8 --workers_per_device 2
    python benchmarks/soak.py --requests 600 --clients 16 -- --replicas 2 --compile eager --batch_size 8
(arguments after `--` go to `thunder-batch serve`)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def fib(n):", "Water boils at"]
MALFORMED = [
    b"{not json",
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "top_k": 100000000000000000000}',
    b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
    json.dumps({"prompt": "x", "stop": "y" * 20000, "n": 2}).encode(),
    b'{"prompt": [], "max_tokens": 2}',
]


class Soak:
    def __init__(self, url: str, hang_s: float, max_tokens: int, seed: int = 0, server_pid: int | None = None):
        self.url, self.hang_s, self.max_tokens, self.server_pid = url, hang_s, max_tokens, server_pid
        self.expected: dict[tuple[str, int], str] = {}
        self.outcomes: Counter = Counter()
        self.problems: list[str] = []
        self.lock, self.done, self.rng = threading.Lock(), 0, random.Random(seed)

    def body(self, prompt: str, tokens: int, **extra) -> dict:
        return {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, **extra}

    def learn_alone(self) -> None:
        """Each (prompt, max_tokens)'s answer with nothing else running: what every duplicate must equal."""
        for prompt in PROMPTS:
            for tokens in range(1, self.max_tokens + 1):
                r = httpx.post(self.url + "/v1/completions", json=self.body(prompt, tokens), timeout=self.hang_s)
                self.expected[prompt, tokens] = r.json()["choices"][0]["text"]

    def one(self, rng: random.Random) -> str:
        kind, prompt, tokens = rng.random(), rng.choice(PROMPTS), rng.randint(1, self.max_tokens)
        url = self.url + "/v1/completions"
        try:
            if kind < 0.1:
                with httpx.stream("POST", url, json=self.body(prompt, tokens, stream=True), timeout=self.hang_s) as r:
                    if r.status_code != 200:
                        return self.status(r.status_code, r.read())
                    next(r.iter_lines())
                return "cancelled"
            if kind < 0.2:
                return self.status(*_post(url, self.body(prompt, self.max_tokens), 0.5))
            if kind < 0.3:
                return self.status(*_post(url, rng.choice(MALFORMED), self.hang_s))
            if kind < 0.65:
                return self.check_stream(url, prompt, tokens)
            status, content = _post(url, self.body(prompt, tokens), self.hang_s)
            if status == 200:
                return self.compare(prompt, tokens, json.loads(content)["choices"][0]["text"])
            return self.status(status, content)
        except httpx.TimeoutException:
            return "gave up (0.5 s)" if 0.1 <= kind < 0.2 else self.problem(f"hang: no answer in {self.hang_s} s")
        except httpx.HTTPError as e:
            return self.problem(f"connection error: {e!r}")

    def check_stream(self, url: str, prompt: str, tokens: int) -> str:
        with httpx.stream("POST", url, json=self.body(prompt, tokens, stream=True), timeout=self.hang_s) as r:
            if r.status_code != 200:
                return self.status(r.status_code, r.read())
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        if events and "error" in events[-1]:
            code = events[-1]["error"]["code"]
            return "503 worker_died (stream)" if code == "worker_died" else self.problem(f"stream error {events[-1]}")
        return self.compare(prompt, tokens, "".join(e["choices"][0]["text"] for e in events))

    def compare(self, prompt: str, tokens: int, text: str) -> str:
        if text != self.expected[prompt, tokens]:
            return self.problem(f"differs from the request alone: {prompt!r} {tokens}: {text!r}")
        return "200 (same as alone)"

    def status(self, status: int, content: bytes) -> str:
        if status < 500:
            return str(status)
        code = json.loads(content).get("error", {}).get("code") if content.startswith(b"{") else None
        return "503 worker_died" if code == "worker_died" else self.problem(f"{status} {content[:200]!r}")

    def problem(self, what: str) -> str:
        with self.lock:
            self.problems.append(what)
            first_hang = what.startswith("hang") and sum(p.startswith("hang") for p in self.problems) == 1
        if first_hang and self.server_pid:
            dump_stacks(self.server_pid)
        return what.split(":")[0]

    def client(self, seed: int, total: int) -> None:
        rng = random.Random(seed)
        while True:
            with self.lock:
                if self.done >= total:
                    return
                self.done += 1
            outcome = self.one(rng)
            with self.lock:
                self.outcomes[outcome] += 1


def _post(url: str, body, timeout: float) -> tuple[int, bytes]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, timeout=timeout)
    return r.status_code, r.content


def rss_mb(pid: int) -> float:
    main = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [main, *main.children(recursive=True)]) / 2**20


def dump_stacks(pid: int) -> None:
    """Every server process's Python stacks on stderr (with py-spy on PATH): what a hang is waiting on."""
    if shutil.which("py-spy") is None:
        print("a hang: put py-spy on PATH to see the server's stacks", file=sys.stderr)
        return
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        print(f"--- pid {p.pid}: {' '.join(p.cmdline())[-80:]}", file=sys.stderr)
        subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], stdout=sys.stderr, stderr=sys.stderr, timeout=60)


def wait_idle(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/stats", timeout=30).json()
        if not (stats["running"] or stats["waiting"] or stats["in_flight"]):
            return
        time.sleep(0.5)


def kill_a_busy_worker(url: str, soak: Soak, at: int) -> None:
    while soak.done < at:
        time.sleep(0.05)
    stats = httpx.get(url + "/stats", timeout=30).json()
    workers = stats.get("workers") or stats["replicas"]  # LitServe workers, or serve --replicas' engines
    victim = max(workers, key=lambda w: w.get("running", 0))
    name = victim.get("replica", victim.get("index"))
    print(f"killing worker {name} (pid {victim['pid']}) after {soak.done} requests", file=sys.stderr)
    os.kill(victim["pid"], signal.SIGKILL)


def start_server(port: int, serve_args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "thunder_batch.cli", "serve", "--port", str(port), "--log_level", "warning"]
    proc = subprocess.Popen([*cmd, *serve_args], stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).text == "ok":
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--max_tokens", type=int, default=12)
    parser.add_argument("--hang_s", type=float, default=120.0, help="a request without an answer this long hangs")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--no_kill", action="store_true", help="kill no worker")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of thunder-batch serve")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = start_server(args.port, args.serve_args)
    try:
        soak = Soak(url, args.hang_s, args.max_tokens, server_pid=proc.pid)
        soak.learn_alone()
        wait_idle(url)
        before = rss_mb(proc.pid)
        start = time.monotonic()
        if not args.no_kill:
            threading.Thread(target=kill_a_busy_worker, args=(url, soak, args.requests // 2), daemon=True).start()
        with ThreadPoolExecutor(args.clients) as pool:
            for f in [pool.submit(soak.client, seed, args.requests) for seed in range(args.clients)]:
                f.result()
        elapsed = time.monotonic() - start
        wait_idle(url)
        deadline = time.monotonic() + 300
        while httpx.get(url + "/health", timeout=30).text != "ok" and time.monotonic() < deadline:
            time.sleep(1)  # the killed worker's replacement
        after = rss_mb(proc.pid)
        report(soak, args, elapsed, before, after)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def report(soak: Soak, args, elapsed: float, before: float, after: float) -> None:
    print(f"{sum(soak.outcomes.values())} requests from {args.clients} clients in {elapsed:.0f} s")
    for outcome, count in sorted(soak.outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}  {outcome}")
    fivexx = [p for p in soak.problems if p[:1] == "5" or p.startswith("stream error")]
    hangs = [p for p in soak.problems if p.startswith("hang")]
    differ = [p for p in soak.problems if p.startswith("differs")]
    print(f"5xx other than the killed worker's: {len(fivexx)}; hangs: {len(hangs)}; answers that differ from")
    print(f"the request alone: {len(differ)}; other problems: {len(soak.problems) - len(fivexx + hangs + differ)}")
    print(f"server RSS: {before:.0f} MB before, {after:.0f} MB after ({after - before:+.0f} MB)")
    for problem in soak.problems[:10]:
        print("  problem:", problem)


if __name__ == "__main__":
    main()
