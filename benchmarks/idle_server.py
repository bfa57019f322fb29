"""What an idle `thunder-batch serve` costs, and how fast it wakes for a request.

    python benchmarks/idle_server.py --seconds 60
    python benchmarks/idle_server.py --seconds 30 --replicas 2     # serve --replicas 2 on a local Ray

1. A live server (the default model, eager, one thread) after its warm-up: CPU-seconds each of its processes
   uses over --seconds with no request, per 10 s, against the 0.05 target; beside it, in the same run, a bare
   uvicorn app's idle cost (the floor: uvicorn wakes every 0.1 s whatever the app does).
2. The worker's wake-up: a request put in a real LitServe (multiprocessing manager) queue and announced, as an
   HTTP process does, until the worker's intake returns it, after the worker slept idle (p50 / max).
3. A one-token completion sent to the idle server, end to end (includes its prompt step).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
import psutil
from soak import start_server  # benchmarks/soak.py: serve on a port, wait until /health says ok

TARGET_CPU_S_PER_10S = 0.05


def idle_cpu(pid: int, seconds: float) -> dict[str, float]:
    """CPU-seconds per 10 s of each process in pid's family, by its role."""
    family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    time.sleep(3)  # past the warm-up's tail

    def cpu() -> dict:
        return {p.pid: sum(p.cpu_times()[:2]) for p in family if p.is_running()}

    before = cpu()
    time.sleep(seconds)
    after = cpu()
    used = {}
    for p in family:
        line = " ".join(p.cmdline())
        role = (
            "worker (spawned)" if "spawn_main" in line else "resource tracker" if "resource_tracker" in line else None
        )
        role = role or ray_role(line, p.pid) or ("main" if p.pid == pid else f"child {p.pid} (HTTP or queue manager)")
        used[role] = (after.get(p.pid, 0) - before.get(p.pid, 0)) * 10 / seconds
    return used


def ray_role(line: str, pid: int) -> str | None:
    """A Ray process's role: an actor's name ("ServeReplica:thunder-batch:Engine"), else its program's."""
    if line.startswith("ray::"):
        return f"ray {line.split()[0].removeprefix('ray::')} {pid}"
    program = os.path.basename(line.split()[0]) if line else ""
    if "/ray/" in line and program:
        return f"ray {program} {pid}" if program not in ("python", "python3") else f"ray {line.split()[1][-40:]} {pid}"
    return None


def bare_uvicorn_cpu(port: int, seconds: float) -> float:
    code = "import uvicorn\nasync def app(s, r, w): pass\nuvicorn.run(app, port=%d, log_level='warning')" % port
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        return sum(idle_cpu(proc.pid, seconds).values())
    finally:
        proc.terminate()
        proc.wait(30)


def wake_latency(trials: int, idle_s: float) -> list[float]:
    """Seconds from put + announce to the intake's return, with LitServe's manager queue."""
    from thunder_batch.serve.loop import EngineLoop
    from thunder_batch.serve.shared_state import SharedState

    manager, state, loop, times = mp.Manager(), SharedState(1, 1), EngineLoop(), []
    queue = manager.Queue()
    for i in range(trials):
        sent: list[float] = []

        def put_later(uid: str, sent: list) -> None:
            time.sleep(idle_s)
            sent.append(time.perf_counter())
            queue.put((0, uid, 0.0, {"prompts": [[1]]}))
            state.announce_request()

        threading.Thread(target=put_later, args=(f"r{i}", sent), daemon=True).start()
        while not loop._take_requests(queue, state.wait_for_request, room=8, gather_s=0.0):
            pass
        times.append(time.perf_counter() - sent[0])
    manager.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="idle time measured")
    parser.add_argument("--port", type=int, default=18231)
    parser.add_argument("--replicas", type=int, default=None, help="serve --replicas N (Ray Serve) instead")
    args = parser.parse_args()
    print("# " + subprocess.run("lscpu | grep Flags", shell=True, capture_output=True, text=True).stdout.strip())
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's processes inherit it: one torch thread
    serve_args = ["--compile", "eager", "--batch_size", "8", "--max_seq_length", "256"]
    serve_args += ["--replicas", str(args.replicas)] if args.replicas else []
    proc = start_server(args.port, serve_args)
    try:
        used = idle_cpu(proc.pid, args.seconds)
        for role, cpu_s in used.items():
            print(f"idle server, {role}: {cpu_s:.4f} CPU-s per 10 s")
        total = sum(used.values())
        print(f"idle server, all processes: {total:.4f} CPU-s per 10 s (target < {TARGET_CPU_S_PER_10S})")
        latencies = []
        for _ in range(5):
            time.sleep(2)
            start = time.perf_counter()
            body = {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=60).raise_for_status()
            latencies.append(time.perf_counter() - start)
        print(f"one-token completion after 2 s idle: p50 {statistics.median(latencies) * 1000:.1f} ms")
    finally:
        proc.terminate()
        proc.wait(90)
    if args.replicas:
        return  # the wake-up below is LitServe's queue, which Ray does not use
    print(f"bare uvicorn app, idle: {bare_uvicorn_cpu(args.port + 1, args.seconds):.4f} CPU-s per 10 s")
    wakes = wake_latency(20, 0.3)
    print(
        f"intake wake-up (manager queue): p50 {statistics.median(wakes) * 1000:.2f} ms, max {max(wakes) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
