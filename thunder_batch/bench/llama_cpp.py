"""llama.cpp as a benchmark peer: its own server on the same requests, from a build the user points to.

`llama-server` (the user's build: `--llama_cpp_bin DIR` or $LLAMA_CPP_BIN) runs a GGUF of the same
weights in the same formats (bench.llama_cpp_files: a file given with `--llama_cpp_gguf`, else the model
written by the bench) on 127.0.0.1 with B parallel slots, continuous batching, the bench's threads. Each
request goes in as its prompt's token ids at its arrival time, greedy (temperature 0), streamed, with
`return_tokens` so its output ids are compared with the engine's. The server's own decode rate (its
`timings`) and its own peak resident memory are kept beside the bench's output tok/s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from thunder_batch.bench.metrics import RequestTrace
from thunder_batch.bench.system_run import BenchContext, SystemRun, wait_until
from thunder_batch.bench.workloads import BenchRequest

SYSTEM = "llama.cpp"
ENV_VAR = "LLAMA_CPP_BIN"
HOW = (
    "point --llama_cpp_bin (or $LLAMA_CPP_BIN) to a llama.cpp build's bin/ (cmake -B build && cmake --build build "
    "--target llama-server; benchmarks/RESULTS.md, Peer setup); the bench writes the model as a GGUF for it, or "
    "give one with --llama_cpp_gguf (e.g. made by llama.cpp's convert_hf_to_gguf.py)"
)


def server_path(bin_dir: str | None) -> Path | None:
    folder = bin_dir or os.environ.get(ENV_VAR)
    path = Path(folder) / "llama-server" if folder else None
    return path if path is not None and path.is_file() else None


def unavailable(bin_dir: str | None, ggufs: str | None) -> str | None:
    """Why llama.cpp cannot run in this bench, or None: a one-line hint on how to get it when it cannot."""
    if server_path(bin_dir) is None:
        return f"no llama.cpp build given: {HOW}"
    missing = [p for p in (ggufs or "").split(",") if p.strip() and not Path(p.strip()).is_file()]
    return f"GGUF not found: {missing}" if missing else None


def peak_rss_mb(pid: int) -> float | None:
    """A live process's peak resident memory (Linux's VmHWM), MiB; None where /proc does not say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(match[1]) / 1024 if match else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server: Path, gguf: str, batch_size: int, ctx: BenchContext) -> tuple[subprocess.Popen, str]:
    """llama-server with B slots of max_seq_length each; returns (process, base URL) once it is healthy."""
    import requests

    port, threads = free_port(), str(torch.get_num_threads())
    command = [str(server), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(batch_size)]
    command += ["-c", str(batch_size * ctx.max_seq_length), "-t", threads, "-tb", threads, "--no-webui"]
    log = tempfile.TemporaryFile()  # its log, unread while it runs: a pipe would fill and stop the server
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"llama-server exited ({process.returncode}): {tail}")
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("llama-server did not become healthy within 120 s")


def complete(url: str, request: BenchRequest, trace: RequestTrace, ignore_eos: bool) -> dict:
    """One streamed greedy completion of the request's token ids; records each chunk's tokens in `trace`.
    Returns the server's timings of it."""
    import requests

    body = dict(prompt=list(request.prompt_ids), n_predict=request.max_new_tokens, temperature=0.0, stream=True)
    body.update(cache_prompt=False, ignore_eos=ignore_eos, return_tokens=True)
    timings = {}
    with requests.post(f"{url}/completion", json=body, stream=True, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens"):
                trace.record(list(chunk["tokens"]), time.perf_counter())
            timings = chunk.get("timings", timings)
    return timings


def send_all(url: str, workload: list[BenchRequest], ignore_eos: bool) -> tuple[list[RequestTrace], list[dict], float]:
    """Every request on its own connection at its arrival time: (traces, the server's timings, wall seconds)."""
    start = time.perf_counter()
    traces = [RequestTrace(len(r.prompt_ids), start + r.arrival_s) for r in workload]
    timings: list[dict] = [{} for _ in workload]

    def one(i: int, request: BenchRequest) -> None:
        wait_until(traces[i].arrival)
        timings[i] = complete(url, request, traces[i], ignore_eos)

    threads = [threading.Thread(target=one, args=(i, r)) for i, r in enumerate(workload)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return traces, timings, time.perf_counter() - start


def run_llama_cpp(workload: list[BenchRequest], batch_size: int, ctx: BenchContext, gguf: str) -> SystemRun:
    """The workload through llama-server on `gguf` (the model's weights: bench.llama_cpp_files) with B slots."""
    from thunder_batch.bench.llama_cpp_files import file_label

    server = server_path(ctx.llama_cpp_bin)
    process, url = start_server(server, gguf, batch_size, ctx)
    try:
        traces, timings, wall = send_all(url, workload, ctx.ignore_eos)
        memory = dict(peak_rss_mb=peak_rss_mb(process.pid), peak_gpu_mb=None)  # the server's own
    finally:
        process.terminate()
        process.wait(timeout=30)
    rates = [t["predicted_per_second"] for t in timings if t.get("predicted_per_second")]
    label, size_mb = file_label(gguf), Path(gguf).stat().st_size / 2**20
    decode = dict(per_sequence_decode_tok_s=sum(rates) / len(rates) if rates else None, gguf=gguf, file_type=label)
    decode["file_mb"] = size_mb
    emitted = sum(len(t.token_ids) for t in traces)
    print(f"[bench] {SYSTEM} B={batch_size}: {emitted} tokens in {wall:.1f}s", file=sys.stderr)
    note = f"llama-server ({server}) on {Path(gguf).name} ({label}, {size_mb:.0f} MiB), {batch_size} slots, greedy, "
    note += "prompts as token ids; memory is the server's own peak"
    return SystemRun(SYSTEM, batch_size, traces, wall, memory, notes=[note], extra=dict(llama_cpp=decode))
