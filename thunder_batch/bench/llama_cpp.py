"""llama.cpp as a benchmark peer: its own server on the same requests, from a build the user points to.

`llama-server` (the user's build: `--llama_cpp_bin DIR` or $LLAMA_CPP_BIN) runs a GGUF of the same
weights (`--llama_cpp_gguf FILE[,FILE]`, f32 and/or bf16, made by llama.cpp's converter: see
benchmarks/RESULTS.md, "Peer setup") on 127.0.0.1 with B parallel slots, continuous batching, the
bench's threads. Each request goes in as its prompt's token ids at its arrival time, greedy
(temperature 0), streamed, with `return_tokens` so its output ids are compared with the engine's. The
server's own decode rate (its `timings`) is kept beside the bench's output tok/s. A precision with no
GGUF of its own is skipped with a note.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from thunder_batch.bench.metrics import PeakMemory, RequestTrace
from thunder_batch.bench.system_run import BenchContext, SystemRun, wait_until
from thunder_batch.bench.workloads import BenchRequest

SYSTEM = "llama.cpp"
ENV_VAR = "LLAMA_CPP_BIN"
HOW = (
    "point --llama_cpp_bin (or $LLAMA_CPP_BIN) to a llama.cpp build's bin/ (cmake -B build && cmake --build build "
    "--target llama-server) and --llama_cpp_gguf to an f32 or bf16 GGUF of the checkpoint made by llama.cpp's "
    "convert_hf_to_gguf.py (benchmarks/RESULTS.md, Peer setup)"
)
FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}  # GGUF general.file_type -> precision


def server_path(bin_dir: str | None) -> Path | None:
    folder = bin_dir or os.environ.get(ENV_VAR)
    path = Path(folder) / "llama-server" if folder else None
    return path if path is not None and path.is_file() else None


def gguf_precision(path: str) -> str:
    """The precision of a GGUF's weights (its general.file_type), e.g. "float32"."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.file_type")
    if field is None:
        raise ValueError(f"{path}: no general.file_type in the GGUF")
    kind = int(field.parts[field.data[0]][0])
    if kind not in FILE_TYPES:
        raise ValueError(f"{path}: GGUF file type {kind} is quantized; give an f32 or bf16 GGUF")
    return FILE_TYPES[kind]


def ggufs_by_precision(ggufs: str | None) -> dict[str, str]:
    return {gguf_precision(p): p for p in (ggufs or "").split(",") if p.strip()}


def unavailable(bin_dir: str | None, ggufs: str | None) -> str | None:
    """Why llama.cpp cannot run in this bench, or None: a one-line hint on how to get it when it cannot."""
    if server_path(bin_dir) is None or not ggufs:
        return f"no llama.cpp build or GGUF given: {HOW}"
    missing = [p for p in ggufs.split(",") if p.strip() and not Path(p.strip()).is_file()]
    if missing:
        return f"GGUF not found: {missing}"
    try:
        ggufs_by_precision(ggufs)
    except ValueError as e:
        return str(e)
    return None


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


def run_llama_cpp(workload: list[BenchRequest], batch_size: int, ctx: BenchContext, precision: str) -> SystemRun:
    """The workload through llama-server at the run's precision (its GGUF) with B slots."""
    gguf, server = ggufs_by_precision(ctx.llama_cpp_gguf)[precision], server_path(ctx.llama_cpp_bin)
    with PeakMemory(ctx.device) as memory:
        process, url = start_server(server, gguf, batch_size, ctx)
        try:
            traces, timings, wall = send_all(url, workload, ctx.ignore_eos)
        finally:
            process.terminate()
            process.wait(timeout=30)
    rates = [t["predicted_per_second"] for t in timings if t.get("predicted_per_second")]
    decode = dict(per_sequence_decode_tok_s=sum(rates) / len(rates) if rates else None, gguf=gguf)
    emitted = sum(len(t.token_ids) for t in traces)
    print(f"[bench] {SYSTEM} B={batch_size}: {emitted} tokens in {wall:.1f}s", file=sys.stderr)
    note = f"llama-server ({server}), {batch_size} slots, greedy, prompts as token ids; memory is the bench's own"
    return SystemRun(SYSTEM, batch_size, traces, wall, memory.as_dict(), notes=[note], extra=dict(llama_cpp=decode))
