"""What every benchmarked system shares: a BenchContext in, a SystemRun out, run on a fresh_model copy.

A system is litgpt's own loop (`baselines`), Hugging Face transformers (`hf_transformers`), llama.cpp's server
(`llama_cpp`) or the engine in one compile mode (`engine_runs`).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from thunder_batch.bench.metrics import RequestTrace
from thunder_batch.bench.options import BenchOptions
from thunder_batch.bench.run_plan import parse_lengths


@dataclass
class BenchContext:
    """Settings shared by every system of one benchmark run."""

    device: torch.device
    max_seq_length: int
    prefill_chunk: int = 64
    prefill_lanes: int = 2
    max_prefill_lanes: int | None = None  # None: B
    attention_lengths: tuple[int, ...] | None = None  # None: the engine's default ladder
    eos_id: int | None = None
    ignore_eos: bool = False
    tokenizer: object = None
    progress: bool = True
    cache_dir: str | None = None  # None: a fresh temporary compile cache (cold compile = real trace)
    warm_compile: bool = True
    profile: bool = False
    llama_cpp_bin: str | None = None  # a llama.cpp build's bin/ (bench.llama_cpp), else $LLAMA_CPP_BIN
    llama_cpp_gguf: str | None = None  # comma-separated GGUF files of the checkpoint (bench.llama_cpp_files)
    llama_cpp_files: dict = field(default_factory=dict)  # precision -> the GGUF llama.cpp runs (set by the run)
    prefix_reuse: bool = True  # engines keep their slots' caches for prompts sharing a prefix
    prefix_store_mb: int = 1024  # host memory for kept prefixes that new prompts write over

    @classmethod
    def from_options(cls, gpt, tokenizer, options: BenchOptions, max_seq_length: int) -> BenchContext:
        """The context of one `thunder-batch bench` run (thunder_batch/cli/bench.py) from its options."""
        return cls(
            device=gpt.transformer.wte.weight.device,
            max_seq_length=max_seq_length,
            prefill_chunk=min(options.prefill_chunk, max_seq_length),
            prefill_lanes=options.prefill_lanes,
            max_prefill_lanes=options.max_prefill_lanes,
            attention_lengths=parse_lengths(options.attention_lengths, max_seq_length),
            eos_id=getattr(tokenizer, "eos_id", None),
            ignore_eos=options.ignore_eos,
            tokenizer=tokenizer,
            progress=options.progress,
            cache_dir=None if options.cache_dir is None else str(options.cache_dir),
            warm_compile=options.warm_compile,
            profile=options.profile,
            llama_cpp_bin=None if options.llama_cpp_bin is None else str(options.llama_cpp_bin),
            llama_cpp_gguf=options.llama_cpp_gguf,
            prefix_reuse=options.prefix_reuse,
            prefix_store_mb=options.prefix_store_mb,
        )

    @property
    def stop_tokens(self) -> tuple[list[int], ...]:
        return () if self.ignore_eos or self.eos_id is None else ([self.eos_id],)


@dataclass
class SystemRun:
    """What one system did on the workload: per-request traces and everything measured around them."""

    system: str
    batch_size: int | None  # None: independent of B (one prompt at a time)
    traces: list[RequestTrace]
    wall_s: float
    memory: dict
    compile: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)  # StepRecord per engine step (engine systems only)
    notes: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    precision: str = "float32"  # of the weights and KV cache (set by the benchmark loop)


def wait_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, leave=False)


def fresh_model(gpt: torch.nn.Module, max_seq_length: int) -> torch.nn.Module:
    """A private copy of the weights, so no system sees another's caches or edits."""
    model = copy.deepcopy(gpt).eval().requires_grad_(False)
    model.max_seq_length = max_seq_length
    return model
