"""The benchmark's options, declared once (BenchOptions): `thunder-batch bench` lists them as its flags
(with the model's, cli/options.py) and every part of the benchmark reads them from here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from thunder_batch.bench.run_plan import ALL_SYSTEMS


@dataclass(frozen=True)
class BenchOptions:
    """What one benchmark run does: the workload, the systems and engine shapes it runs, what it writes.

    Args:
        dataset: "prompts": the shipped real prompts (chat template applied); "grounded": shipped chat
            prompts holding a passage to repeat, summarize or edit; "random": random token ids;
            "multi-turn": `num_requests` conversations of `turns` turns, each turn the conversation so far
            and `input_len` new user tokens; "shared-prefix": `num_requests` requests at once sharing an
            `input_len`-token system prompt, each with 40 tokens of its own, and a control workload
            sharing nothing. Both run each engine system of `systems` with prefix reuse off and on and
            compare them (other systems and options are ignored; `batch_size`: the first one);
            "json-schema": `num_requests` chat requests each asking for JSON of its own schema (fixed keys), run
            free, constrained, and constrained with forced tokens per engine system and batch size, and through
            llama-server free and with `json_schema` when a llama.cpp build and GGUF are given (bench/json_schema.py).
        num_requests: Number of requests (N).
        max_new_tokens: Most tokens per request; each request's limit is drawn uniformly from
            [max_new_tokens * (1 - range_ratio), max_new_tokens].
        input_len: Mean prompt length of the random dataset.
        range_ratio: Spread of the seeded length distributions (0: all lengths equal).
        batch_size: Engine slots B, or a sweep such as "1,4,8,16".
        prefill_chunk: Prompt tokens a prefill lane feeds per step (C).
        prefill_lanes: Prefill lanes per step (P, at most B): prompts read at once beside the decode rows.
        max_prefill_lanes: Widest step while many slots have prompt left (4x, 16x ... P lanes); None: B.
        attention_lengths: Comma-separated rungs of the attention-length ladder, e.g. "256,512"; None:
            the engine's default (256, 512, ... up to max_seq_length).
        max_seq_length: KV cache length per slot; None fits the workload (rounded up to 64).
        turns: Turns per conversation of the multi-turn dataset.
        repeats: Runs of each multi-turn / shared-prefix workload with reuse off and on (json-schema: of each
            variant), alternating; the fastest of each is compared (the machine's noise).
        prefix_reuse: Engines keep their slots' caches for prompts sharing a prefix (the other datasets).
        prefix_store_mb: Host memory (MiB) for kept prefixes that new prompts write over (0: none, so
            only the slots keep prefixes).
        speculative_tokens: Comma-separated draft lengths k, e.g. "0,4,8": other than "0", runs the
            engine systems of `systems` (thunder-default when none is named) at each batch size and each
            k on the dataset, greedy, and reports decode tok/s, tokens per decode step, the drafts'
            acceptance rate and whether every request's tokens equal those of k = 0.
        request_rate: Requests per second of a Poisson arrival process; inf sends all at once (offline).
        seed: Seed of the workload (lengths, random tokens, prompt order, arrival times).
        ignore_eos: Generate exactly each request's token limit, ignoring the end-of-sequence token.
        systems: Comma-separated systems to run, from litgpt-sequential, litgpt-batched, eager,
            thunder-default (the engine's default executors), thunder-torch, thunder-torchcompile,
            thunder-nvfuser, hf-transformers, hf-transformers-compile
            (Hugging Face transformers' generate on static batches; the `hf` extra), llama.cpp (its server
            with B slots, from --llama_cpp_bin, on the model's own weights). A system may be restricted to some
            precisions and batch sizes: `name@precision[/precision]:B[/B]`, e.g. "thunder-torch@float32:32"
            runs thunder-torch in float32 at B=32 only; a plain name runs every precision at every batch size.
        precisions: Comma-separated precisions, e.g. "float32,bfloat16"; None: the model's --precision.
            The checkpoint is loaded once in --precision; each other precision runs on a converted copy.
            Peak matmul FLOP/s is measured per precision; litgpt-sequential's fastest precision is the
            baseline of vs_litgpt_sequential, the other ratios and the greedy-token checks compare runs of
            the same precision.
        device: "cpu" or "cuda": where the command loads the model (the systems run where the model is).
        cache_dir: Compile cache root; None uses a fresh temporary dir so cold compile is a real trace.
        warm_compile: Also time a second engine loading the compiled programs from the compile cache.
        profile: Profile one decode step of every engine run (top ops by self time).
        llama_cpp_bin: A llama.cpp build's bin/ folder holding llama-server, for the `llama.cpp` system
            (None: $LLAMA_CPP_BIN). Without it that system is skipped with a line saying how.
        llama_cpp_gguf: Comma-separated GGUF files of the checkpoint (e.g. made by llama.cpp's own converter);
            each serves the model whose linears are in its formats. Any other model is written by the bench
            (a GGUF checkpoint is given as it is).
        output_json: Write every number, versions and machine info here.
        plot: Write a PNG here: tokens/s vs batch size per system, and the TTFT distribution.
        progress: tqdm progress bars on stderr.
        matmul_n: Size n of the n x n x n matmul that measures each precision's peak FLOP/s.
        copy_mb: MiB copied to measure the peak copy bandwidth.
    """

    dataset: Literal["prompts", "grounded", "random", "multi-turn", "shared-prefix", "json-schema"] = "prompts"
    num_requests: int = 32
    max_new_tokens: int = 64
    input_len: int = 128
    range_ratio: float = 0.5
    batch_size: str = "8"
    prefill_chunk: int = 64
    prefill_lanes: int = 2
    max_prefill_lanes: int | None = None
    attention_lengths: str | None = None
    max_seq_length: int | None = None
    turns: int = 8
    repeats: int = 1
    prefix_reuse: bool = True
    prefix_store_mb: int = 1024
    speculative_tokens: str = "0"
    request_rate: float = math.inf
    seed: int = 0
    ignore_eos: bool = False
    systems: str = ",".join(ALL_SYSTEMS)
    precisions: str | None = None
    device: str = "cpu"
    cache_dir: Path | None = None
    warm_compile: bool = True
    profile: bool = False
    llama_cpp_bin: Path | None = None
    llama_cpp_gguf: str | None = None
    output_json: Path | None = None
    plot: Path | None = None
    progress: bool = True
    matmul_n: int = 2048
    copy_mb: int = 256

    @property
    def online(self) -> bool:
        """Requests arrive over time (a finite request_rate), not all at once."""
        return not math.isinf(self.request_rate)
