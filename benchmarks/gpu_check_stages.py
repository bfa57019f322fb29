"""The GPU check's proving stages, in priority order: a smoke test that fails fast and says which part is
incompatible, then parity (Thunder vs eager, Thunder + CUDA graphs vs eager, eager vs litgpt's
generate_fn) on the layered program with the fewest step shapes, then what the traces fuse, then the
test suite's CUDA tests (`pytest -m cuda`)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.bench.parity import compare_tokens, litgpt_greedy

# Two step shapes (decode only; 2 lanes of 16): max_prefill_lanes=2 keeps the lane ladder at one rung,
# max_seq_length 128 keeps the attention ladder at one rung.
PARITY = dict(batch_size=4, max_seq_length=128, prefill_chunk=16, max_prefill_lanes=2)
PARITY_LENGTHS = [5, 17, 33, 2, 12, 40]  # 6 prompts through 4 slots: slots reused, prompts chunked
PARITY_NEW = 16

MODES = {
    "eager": dict(compile="eager"),
    "thunder": dict(compile="thunder"),  # the layered program (trace="layers")
    "thunder-cudagraphs": dict(compile="thunder", cuda_graphs=True),
}


def prompts_of(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# -- smoke -----------------------------------------------------------------------------------------
def run_smoke(report, device: str) -> bool:
    """Imports, one tiny thunder.jit, one CUDA graph capture of the project's backend; False if any failed."""
    with report.stage("smoke: imports"):
        from thunder_batch._compat import import_thunder

        import_thunder()
        import litgpt  # noqa: F401

        from thunder_batch.compile import step  # noqa: F401
    with report.stage(f"smoke: thunder.jit on {device}"):
        thunder = import_thunder()
        a, b = torch.randn(8, 16, device=device), torch.randn(16, 4, device=device)
        torch.testing.assert_close(thunder.jit(lambda x, y: torch.relu(x @ y) + 1)(a, b), torch.relu(a @ b) + 1)
    if device != "cuda":
        report.needs_cuda("smoke: CUDA graph capture")
    else:
        with report.stage("smoke: CUDA graph capture"):
            from thunder_batch.compile.cuda_graphs import CUDAGraphs

            static = torch.zeros(4, device="cuda")
            graph, out = CUDAGraphs(torch.device("cuda")).capture(lambda: static * 2 + 1)
            static.copy_(torch.arange(4.0, device="cuda"))
            graph.replay()
            torch.testing.assert_close(out, torch.arange(4.0, device="cuda") * 2 + 1)
    return not report.failed("smoke")


# -- parity ----------------------------------------------------------------------------------------
def parity_engine(gpt, mode: str) -> Engine:
    return Engine(copy.deepcopy(gpt), EngineConfig(**MODES[mode], **PARITY))


def generate_tokens(engine: Engine, prompts) -> list[list[int]]:
    results = engine.generate(prompts, SamplingParams(max_new_tokens=PARITY_NEW, ignore_eos=True))
    return [r.token_ids for r in results]


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    """The benchmark's token diff, plus `match`: every prompt identical and none missing."""
    check = compare_tokens(want, got)
    return dict(check, match=check["mismatched_requests"] == 0 and len(got) == len(want))


def run_parity(report, gpt, device: str) -> Engine | None:
    """Eager reference, then Thunder vs eager (its seconds per shape set the budget's estimate), Thunder
    + CUDA graphs vs eager, eager vs litgpt. Returns the Thunder engine (its traces, for the fusions)."""
    prompts = prompts_of(PARITY_LENGTHS, gpt.config.vocab_size, seed=1)
    shapes = len(EngineConfig(**PARITY).step_shapes)
    section = report.data.setdefault(
        "parity", dict(dtype="float32", **PARITY, step_shapes=shapes, max_new_tokens=PARITY_NEW, compile_s={})
    )
    section["prompt_lengths"], eager, thunder = PARITY_LENGTHS, None, None
    with report.stage("parity: eager engine (the reference)"):
        eager = generate_tokens(parity_engine(gpt, "eager"), prompts)
    if eager is None:
        return None
    for mode in ("thunder", "thunder-cudagraphs"):
        if mode == "thunder-cudagraphs" and device != "cuda":
            report.needs_cuda("parity: thunder-cudagraphs vs eager")
            continue
        if not report.has_time(report.compile_estimate(shapes), f"parity {mode}"):
            continue
        with report.stage(f"parity: {mode} vs eager"):
            engine = parity_engine(gpt, mode)
            compile_s = {w: round(s, 2) for w, s in engine.warmup().items()}
            section["compile_s"][mode] = compile_s
            if mode == "thunder":
                report.observe_compile(compile_s)  # traced afresh: the budget's measure
                thunder = engine
            report.check(f"{mode}_vs_eager", compare(generate_tokens(engine, prompts), eager))
            section[f"{mode}_stats"] = _program_stats(engine)
    with report.stage("parity: eager engine vs litgpt generate_fn"):
        report.check(
            "eager_vs_litgpt_generate_fn", compare(eager, [litgpt_greedy(gpt, p, PARITY_NEW) for p in prompts])
        )
    return thunder


def _program_stats(engine: Engine) -> dict:
    keys = ("cache_misses", "traced", "disk_cache_hits", "compile_seconds", "trace_speedups", "cuda_graphs")
    stats = engine.stats()
    return {k: stats[k] for k in keys if k in stats}


# -- fusions ---------------------------------------------------------------------------------------
def run_fusions(report, gpt, device: str, thunder: Engine | None) -> None:
    """Fusion regions of the default compile (the Thunder parity engine's traces) and, on CUDA, of a
    decode-only engine (one step shape) on the fusing executor that is there: nvFuser, else torch.compile."""
    from thunder_batch.compile.executors import executor_availability
    from thunder_batch.compile.step import execution_traces
    from thunder_batch.compile.trace_fusions import fusion_line, fusion_summary

    section = report.data.setdefault("fusions", {"lines": {}})
    if thunder is not None:
        with report.stage("fusions: default executors"):
            section["default"] = fusion_summary(execution_traces(thunder.runner.step_fn))
            section["lines"]["default"] = fusion_line(section["default"])
    if device != "cuda":
        report.needs_cuda("fusions: nvFuser (or torch.compile) claiming the KV write")
        return
    nvfuser_missing = executor_availability()["nvfuser"]
    executor = "torchcompile" if nvfuser_missing else "nvfuser"
    section["nvfuser"] = nvfuser_missing or "available"
    if not report.has_time(2 * report.compile_estimate(1), f"fusions: {executor}"):  # torch.compile: slower
        return
    with report.stage(f"fusions: {executor}"):
        config = EngineConfig(executors=(executor, "sdpa", "torch"), batch_size=4, max_seq_length=64, prefill_chunk=1)
        engine = Engine(copy.deepcopy(gpt), config)
        engine.warmup()
        section[executor] = fusion_summary(execution_traces(engine.runner.step_fn))
        line = fusion_line(section[executor])
        section["lines"][executor] = line if not nvfuser_missing else f"{line} (nvFuser absent: {nvfuser_missing})"


CUDA_TESTS_S = 240  # what `pytest -m cuda` may take: tiny models, a few traced shapes each


def run_cuda_tests(report, device: str) -> None:
    """The suite's CUDA tests, which skip on every CPU machine: here they run, and a failure fails the check."""
    if device != "cuda":
        report.needs_cuda("pytest -m cuda (the test suite's CUDA tests)")
        return
    if not report.has_time(CUDA_TESTS_S, "pytest -m cuda"):
        return
    root = Path(__file__).resolve().parent.parent
    with report.stage("cuda tests: pytest -m cuda"):
        command = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=CUDA_TESTS_S)
        lines = (done.stdout or "").strip().splitlines()
        summary = lines[-1] if lines else done.stderr[-500:]
        report.data["cuda_tests"] = dict(returncode=done.returncode, summary=summary, tail=done.stdout[-4000:])
        # pytest exits 0 when every selected test passed (5: none collected, a failure of the stage too)
        report.check("pytest_cuda", dict(match=done.returncode == 0, summary=summary))
