"""Time to first token, cold (empty compile cache: trace) vs warm (fresh process, load from disk).

    python benchmarks/compile_cache_ttft.py --model tiny      # 2-layer llama-style test model
    python benchmarks/compile_cache_ttft.py --model default   # SmolLM2-135M (minutes per cold shape)

Each phase runs in its own process; times are from process start (before imports) to the first
token of one prompt, after `Engine.warmup()` has made every step shape. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import time; START = time.perf_counter()
import json, sys, torch
from thunder_batch import Engine, EngineConfig, SamplingParams
imported = time.perf_counter() - START
model, root = sys.argv[1], sys.argv[2]
if model == "tiny":
    import litgpt
    torch.manual_seed(0)
    cfg = litgpt.Config.from_name("SmolLM2-135M", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                                  intermediate_size=128, block_size=128, vocab_size=256, padded_vocab_size=256)
    config = EngineConfig(batch_size=4, max_seq_length=64, prefill_chunk=8, cache_dir=root)
    engine = Engine(litgpt.GPT(cfg).eval(), config)
    prompt = [1, 2, 3, 4, 5]
else:
    engine = Engine.from_checkpoint(None, EngineConfig(cache_dir=root))
    prompt = "The capital of France is"
loaded = time.perf_counter() - START
per_shape = engine.warmup()
warm = time.perf_counter() - START
first = next(iter(engine.stream([prompt], SamplingParams(max_new_tokens=2))))
ttft = time.perf_counter() - START
stats = engine.stats()
print(json.dumps(dict(per_shape_s=per_shape, import_s=imported, model_s=loaded - imported, compile_s=warm - loaded,
                      ttft_s=ttft,
                      traced=stats["traced"], disk_cache_hits=stats["disk_cache_hits"],
                      compile_seconds=stats["compile_seconds"], first_token=first.token_ids)))
"""


def run_phase(model: str, root: str) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model, root], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["tiny", "default"], default="tiny")
    parser.add_argument("--cache-dir", default=None, help="default: a new temp dir (so the cold run is cold)")
    args = parser.parse_args()
    root = args.cache_dir or tempfile.mkdtemp(prefix="tb_cache_")
    cold = run_phase(args.model, root)
    print(f"cold: {json.dumps(cold)}", file=sys.stderr)
    warm = run_phase(args.model, root)
    print(
        json.dumps(
            dict(
                model=args.model,
                cache_dir=root,
                cold=cold,
                warm=warm,
                ttft_ratio=warm["ttft_s"] / cold["ttft_s"],
                compile_ratio=warm["compile_s"] / cold["compile_s"],
            )
        )
    )


if __name__ == "__main__":
    main()
