"""The engine and llama.cpp on the same quantized GGUF file of a 1-8B-shaped model with random weights.

For each format: a litgpt config (default SmolLM2-1.7B-Instruct) with random weights is quantized with the `gguf`
package and written as a GGUF (thunder_batch.gguf_write; decode cost does not depend on the values); a K-quant mix
(q4_k_m, q5_k_m, q6_k) is written as llama.cpp's mix of random blocks (gguf_write.write_random_gguf). Then, each in
its own process (so peak RSS is that run's own):
- the engine loads the file (its linears kept quantized) and runs B fresh 64-token prompts, 32 new tokens each, all
  at once (prefix reuse off, EOS ignored), after a warm-up that compiles every step shape; decode ms per step from
  the same prompts with 1 and with 32 new tokens; pp512: one 512-token prompt, 1 new token;
- llama.cpp: `llama-batched-bench` (-npp 64 -ntg 32 -npl B) and `llama-bench -p 512 -n 0` on the same file.
Output tok/s = B x new tokens / wall, prompt time included, both sides. The machine's plain read bandwidth (a sum
over 1 GiB) is measured in the same run; the engine's B=1 decode step reads the file's linears (blocks and head) at
"weights GB/s", a fraction of it.

    python benchmarks/quantized_vs_llama_cpp.py --llama_cpp_bin /path/to/llama.cpp/build/bin --formats q8_0,q4_0,q4_k_m
    python benchmarks/quantized_vs_llama_cpp.py --llama_cpp_bin ... --gguf FILE.gguf --batches 1,8,64
    python benchmarks/quantized_vs_llama_cpp.py --llama_cpp_bin ... --int8   # the engine also with int8_activations
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ENGINE_RUN = """
import json, os, sys, time, random
import torch
from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.bench.llama_cpp import peak_rss_mb
from thunder_batch.checkpoints import load_checkpoint
path, batches, prompt, new = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
int8 = sys.argv[5] == "int8"
model, tok, config = load_checkpoint(path)
rng = random.Random(0)
fresh = lambda n, length=prompt: [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]
def wall(engine, prompts, new_tokens):
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - start
out = {}
for b in batches:
    config = EngineConfig(batch_size=b, max_seq_length=prompt + new, prefix_reuse=False, int8_activations=int8)
    engine = Engine(model, config, tok)
    wall(engine, fresh(b), new); wall(engine, fresh(b), 1)  # compiles every shape
    full, first = wall(engine, fresh(b), new), wall(engine, fresh(b), 1)
    out[b] = dict(output_tok_s=b * new / full, decode_ms=1000 * (full - first) / (new - 1))
engine = Engine(model, EngineConfig(batch_size=1, max_seq_length=513, prefix_reuse=False, int8_activations=int8), tok)
wall(engine, fresh(1, 512), 1)
out["pp512"] = 512 / min(wall(engine, fresh(1, 512), 1) for _ in range(2))
# VmHWM, not ru_maxrss: Linux carries a forked parent's resident size into ru_maxrss across exec
out["peak_rss_gb"] = peak_rss_mb(os.getpid()) * 2**20 / 1e9
print("RESULT " + json.dumps(out))
"""


def write_file(model_name: str, file_format: str, folder: Path) -> Path:
    """The random-weights file of this format, kept in `folder` under a name keyed on the writer's source."""
    import hashlib

    import litgpt
    import torch

    from thunder_batch import gguf_write, quantized

    sources = b"".join(Path(m.__file__).read_bytes() for m in (gguf_write, quantized))
    path = folder / f"{model_name}.{file_format}.{hashlib.sha256(sources).hexdigest()[:12]}.gguf"
    if path.exists():
        return path
    if file_format in gguf_write.K_MIXES:
        return gguf_write.write_random_gguf(litgpt.Config.from_name(model_name), path, file_format)
    torch.manual_seed(0)
    model = litgpt.GPT(litgpt.Config.from_name(model_name)).eval()
    start = time.perf_counter()
    quantized.quantize_model(model, file_format)
    print(f"quantized to {file_format} in {time.perf_counter() - start:.0f} s", flush=True)
    gguf_write.write_gguf(model, path, file_format)
    return path


def run_engine(path: Path, batches: str, prompt: int, new: int, int8: bool = False) -> dict:
    args = [sys.executable, "-c", ENGINE_RUN, str(path), batches, str(prompt), str(new), "int8" if int8 else "exact"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


# Runs a command and prints its peak resident memory (kB) on stderr: the peak of that command alone.
PEAK = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); " + (
    "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)"
)


def with_peak(cmd: list[str]) -> tuple[str, float]:
    """(stdout, peak RSS in GB) of a command."""
    done = subprocess.run([sys.executable, "-c", PEAK, *cmd], capture_output=True, text=True, check=True)
    return done.stdout, int(re.search(r"PEAK (\d+)", done.stderr)[1]) / 1e6


def run_llama_cpp(bin_dir: Path, path: Path, batches: str, prompt: int, new: int) -> dict:
    """llama-batched-bench's rows per B, and llama-bench's pp512 tok/s, with 2 threads."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(path), "-c", "4096", "-b", "2048", "-ub", "512"]
    cmd += ["-npp", str(prompt), "-ntg", str(new), "-npl", batches, "-t", "2"]
    text, peak = with_peak(cmd)
    out = {"peak_rss_gb": peak}
    for row in re.findall(r"^\|\s*\d+\s*\|\s*\d+\s*\|.*$", text, re.MULTILINE):
        cells = [c.strip() for c in row.strip("|").split("|")]
        b, tg_seconds, total_seconds = int(cells[2]), float(cells[6]), float(cells[8])
        out[b] = dict(output_tok_s=b * new / total_seconds, decode_ms=1000 * tg_seconds / new)
    bench = [str(bin_dir / "llama-bench"), "-m", str(path), "-p", "512", "-n", "0", "-t", "2", "-r", "2", "-o", "json"]
    out["pp512"] = json.loads(subprocess.run(bench, capture_output=True, text=True, check=True).stdout)[0]["avg_ts"]
    return out


def read_bandwidth_gb_s() -> float:
    """The machine's plain read bandwidth: the best of 5 sums over 1 GiB of float32."""
    import torch

    buffer = torch.ones(2**28)
    buffer.sum()
    seconds = min(timed(buffer.sum) for _ in range(5))
    return buffer.numel() * 4 / seconds / 1e9


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def linear_bytes(path: Path) -> int:
    """Bytes a decode step reads of the file's weights: its linears (the blocks' and the head, tied or not)."""
    import gguf

    from thunder_batch.bench.llama_cpp_files import _LINEAR

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    head = 0 if "output.weight" in tensors else tensors["token_embd.weight"]
    return head + sum(n for name, n in tensors.items() if _LINEAR.fullmatch(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama_cpp_bin", type=Path, required=True)
    parser.add_argument("--model", default="SmolLM2-1.7B-Instruct")
    parser.add_argument("--formats", default="q8_0,q4_0")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/quantized_bench"))
    parser.add_argument("--gguf", type=Path, help="an existing GGUF file to run instead (e.g. the bundled Q4_1 one)")
    parser.add_argument("--int8", action="store_true", help="the engine also with int8_activations (rows 'int8')")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    files = {args.gguf.name: args.gguf} if args.gguf else {}
    bandwidth = read_bandwidth_gb_s()
    print(f"plain read bandwidth: {bandwidth:.1f} GB/s", flush=True)
    print("| format | B | engine output tok/s | llama.cpp | engine x | engine decode ms | llama.cpp decode ms |")
    print("|---|---|---|---|---|---|---|")
    for file_format in files or args.formats.split(","):
        path = files.get(file_format) or write_file(args.model, file_format, args.folder)
        peer = run_llama_cpp(args.llama_cpp_bin, path, args.batches, 64, 32)
        for int8 in (False, True) if args.int8 else (False,):
            engine = run_engine(path, args.batches, 64, 32, int8)
            report(file_format + (" int8" if int8 else ""), args.batches, engine, peer, path)
            if "1" in args.batches.split(","):
                rate = linear_bytes(path) / engine["1"]["decode_ms"] / 1e6
                print(f"| {file_format} | B=1 weights GB/s | {rate:.1f} ({rate / bandwidth:.0%} of plain read) |")


def report(file_format: str, batches: str, engine: dict, peer: dict, path: Path) -> None:
    for b in batches.split(","):
        e, p = engine[b], peer[int(b)]
        ratio = e["output_tok_s"] / p["output_tok_s"]
        print(
            f"| {file_format} | {b} | {e['output_tok_s']:.1f} | {p['output_tok_s']:.1f} | {ratio:.2f}x |"
            f" {e['decode_ms']:.1f} | {p['decode_ms']:.1f} |"
        )
    print(
        f"| {file_format} | pp512 | {engine['pp512']:.0f} | {peer['pp512']:.0f} | "
        f"{engine['pp512'] / peer['pp512']:.2f}x | peak RSS engine {engine['peak_rss_gb']:.2f} GB | "
        f"llama.cpp {peer['peak_rss_gb']:.2f} GB (file {path.stat().st_size / 1e9:.2f} GB) |",
        flush=True,
    )


if __name__ == "__main__":
    main()
