"""EngineConfig: frozen, validated at construction with messages naming the limit (SamplingParams: sampling_params)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from thunder_batch.param_error import ParamError, is_int, require_int
from thunder_batch.sampling_params import MAX_LOGPROBS, MAX_SEED, MAX_STOP_LENGTH, SamplingParams, choice_seed

__all__ = [  # SamplingParams and its limits live in sampling_params; imported from here as before
    "MAX_LOGPROBS",
    "MAX_SEED",
    "MAX_STOP_LENGTH",
    "ContextLengthError",
    "EngineConfig",
    "ParamError",
    "SamplingParams",
    "StepShape",
    "choice_seed",
    "is_chat",
    "is_int",
]

COMPILE_MODES = ("thunder", "eager")
# GGUF formats a float32 model can be quantized to as it loads (quantized.py; the `gguf` package makes them).
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
TRACE_MODES = ("layers", "step")


class ContextLengthError(ValueError):
    """A prompt and its max_new_tokens do not fit in a slot's cache of max_seq_length tokens.
    max_new_tokens is None when the request asked for the rest of the cache (at least 1 token);
    at_least: prompt_tokens is a lower bound (a text refused before it was tokenized)."""

    def __init__(
        self, prompt_tokens: int, max_new_tokens: int | None, max_seq_length: int, at_least: bool = False
    ) -> None:
        wanted = "at least 1" if max_new_tokens is None else max_new_tokens
        counted = f"at least {prompt_tokens}" if at_least else prompt_tokens
        super().__init__(
            f"prompt ({counted} tokens) + max_new_tokens ({wanted}) exceeds max_seq_length ({max_seq_length})"
        )
        self.prompt_tokens, self.max_new_tokens, self.max_seq_length = prompt_tokens, max_new_tokens, max_seq_length
        self.at_least = at_least


def is_chat(prompt) -> bool:
    """A prompt of chat messages: a list of message dicts (a list of ints is token ids)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def _as_tuple(value):
    """Lists (from JSON or a CLI) as tuples, so the config stays hashable; anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class StepShape:
    """One compiled step shape: `lanes` prefill lanes (0: decode only) and `length` cache entries read."""

    lanes: int
    length: int
    verify: bool = False  # lanes of speculative_tokens + 1 rows checking drafts (speculative decoding)

    def describe(self, config: EngineConfig) -> str:
        if self.verify:
            kind = f"{self.lanes}x{config.speculative_tokens + 1} verify + "
        else:
            kind = f"{self.lanes}x{config.prefill_chunk} prefill + " if self.lanes else ""
        return f"{kind}{config.batch_size} decode rows, attend {self.length}"


@dataclass(frozen=True)
class EngineConfig:
    """Shape of the compiled step: B slots with a cache of `max_seq_length` tokens each; a step feeds
    B decode rows plus, while prompts are being read, lanes of `prefill_chunk` tokens (`prefill_lanes`,
    or 4x, 16x ... that up to `max_prefill_lanes` while that many slots have prompt left), and attends
    over the first L cache entries, L a rung of `attention_lengths`."""

    batch_size: int = 8
    max_seq_length: int = 1024
    prefill_chunk: int = 64
    prefill_lanes: int | None = None  # None: 2, or batch_size if smaller
    max_prefill_lanes: int | None = None  # None: batch_size; prefill_lanes: never wider steps
    # Rungs L of the attention-length ladder, each <= max_seq_length (which is always the top rung).
    # None: 256, 512, 1024, ... below max_seq_length, then max_seq_length. Resolved: `ladder`.
    attention_lengths: tuple[int, ...] | None = None
    compile: str = "thunder"
    executors: tuple[str, ...] | None = None  # None: the project's kernels, then Thunder's defaults
    # One CUDA graph per step shape and head over the whole step (compile.cuda_graphs); needs CUDA
    cuda_graphs: bool = False
    cache_dir: str | None = None  # compile cache root; None: $THUNDER_BATCH_CACHE_DIR, else ./compile_cache
    # "layers": prefix, blocks and head traced apart, layers sharing block traces (seconds to compile,
    # stored in the compile cache); "step": the whole step as one trace (minutes; in memory only)
    trace: str = "layers"
    # Keep each slot's cache after its request ends and feed a new prompt only past the prefix a slot
    # already holds (in place, or copied from another slot when that saves `prefix_copy_min` tokens:
    # a copy of any length costs well under a token's compute, benchmarks/prefix_copy.py).
    prefix_reuse: bool = True
    prefix_copy_min: int = 1
    # Host memory (MiB) for kept entries a new prompt is about to write over, restored for a later prompt
    # sharing them (more conversations than slots); 0: none. Needs prefix_reuse.
    prefix_store_mb: int = 1024
    # Speculative decoding (drafts.py): a decoding slot whose last n tokens (n from ngram_max down to
    # ngram_min) occurred earlier in its prompt or output proposes up to k tokens that followed them,
    # and one step checks them all; outputs are those of k = 0 (off). See DESIGN "Speculative decoding".
    speculative_tokens: int = 0
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 3
    # A constrained request's next tokens that its grammar alone allows (a JSON key, a tool call's tags) may be
    # appended without sampling and fed at once through a prefill lane (constraints.Constraint.forced): the same
    # tokens as sampling them one step each, in fewer but dearer steps. None: where the engine's measured step
    # times say the lane pays (forced.py); True: always; False: never (one step a token).
    forced_tokens: bool | None = None
    # Block linears and head as GGUF quantized blocks of this format (quantized.QUANTIZABLE: q8_0 ... q5_1),
    # made from the model's float32 weights when the engine is built (the model is changed in place); None: as
    # loaded (a GGUF file's quantized linears stay quantized either way). float32 activations, CPU.
    quantization: str | None = None
    # True: quantized linears multiply x rounded to int8 per 32 values (llama.cpp's way: integer dot products,
    # about twice as fast at one row on 4-bit formats) instead of exact float32 x (quantized_int8.cpp); opt-in, as
    # the outputs leave the exact path's by x's rounding. It is a switch on the model's quantized linears, which
    # True or False sets (needs some: a GGUF file or `quantization`); None leaves it as it is (off unless set).
    int8_activations: bool | None = None

    def __post_init__(self) -> None:
        require_int("batch_size", self.batch_size, 1)
        require_int("max_seq_length", self.max_seq_length, 2)
        require_int("prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_chunk > self.max_seq_length:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must be <= max_seq_length ({self.max_seq_length})")
        self._check_lanes()
        if self.attention_lengths is not None:
            object.__setattr__(self, "attention_lengths", _as_tuple(self.attention_lengths))
        self.ladder  # noqa: B018  (validates the rungs)
        if not isinstance(self.prefix_reuse, bool):
            raise ParamError("prefix_reuse", f"prefix_reuse must be True or False, got {self.prefix_reuse!r}")
        require_int("prefix_copy_min", self.prefix_copy_min, 1)
        require_int("prefix_store_mb", self.prefix_store_mb, 0)
        self._check_speculative()
        if self.forced_tokens is not None and not isinstance(self.forced_tokens, bool):
            raise ParamError("forced_tokens", f"forced_tokens must be None, True or False, got {self.forced_tokens!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            choices = ", ".join(QUANTIZATIONS)
            raise ParamError("quantization", f"quantization must be one of {choices}; got {self.quantization!r}")
        if self.int8_activations is not None and not isinstance(self.int8_activations, bool):
            message = f"int8_activations must be None, True or False, got {self.int8_activations!r}"
            raise ParamError("int8_activations", message)
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {TRACE_MODES}, got {self.trace!r}")
        if self.executors is not None:
            object.__setattr__(self, "executors", tuple(self.executors))

    # Fields stay as given (None: a default that follows the other fields, also after dataclasses.replace);
    # the properties below resolve them.
    def _check_lanes(self) -> None:
        require_int("prefill_lanes", self.admit_lanes, 0)
        if self.admit_lanes > self.batch_size:
            raise ParamError(
                "prefill_lanes", f"prefill_lanes ({self.admit_lanes}) must be <= batch_size ({self.batch_size})"
            )
        if not is_int(self.burst_lanes) or not self.admit_lanes <= self.burst_lanes <= self.batch_size:
            raise ParamError(
                "max_prefill_lanes",
                f"max_prefill_lanes must be an int in [prefill_lanes={self.admit_lanes}, "
                f"batch_size={self.batch_size}], got {self.max_prefill_lanes!r}",
            )

    def _check_speculative(self) -> None:
        require_int("speculative_tokens", self.speculative_tokens, 0)
        if self.speculative_tokens >= self.prefill_chunk:  # a verify lane's pads use a prefill lane's scratch
            message = f"speculative_tokens ({self.speculative_tokens}) must be < prefill_chunk ({self.prefill_chunk})"
            raise ParamError("speculative_tokens", message)
        require_int("speculative_ngram_min", self.speculative_ngram_min, 1)
        require_int("speculative_ngram_max", self.speculative_ngram_max, self.speculative_ngram_min)

    @property
    def admit_lanes(self) -> int:
        """P: prefill_lanes, default 2 (at most batch_size)."""
        return min(2, self.batch_size) if self.prefill_lanes is None else self.prefill_lanes

    @property
    def burst_lanes(self) -> int:
        """The widest step's lanes: max_prefill_lanes, default batch_size."""
        return self.batch_size if self.max_prefill_lanes is None else self.max_prefill_lanes

    @functools.cached_property  # read every step: derived once (replace() makes a new config)
    def ladder(self) -> tuple[int, ...]:
        """Rungs L of the attention-length ladder, ascending, max_seq_length last."""
        S, rungs = self.max_seq_length, self.attention_lengths
        if rungs is None:
            rungs = tuple(256 * 2**i for i in range(max(S.bit_length() - 8, 0)) if 256 * 2**i < S)
        if not isinstance(rungs, tuple) or not all(is_int(r) and 1 <= r <= S for r in rungs):
            raise ParamError(
                "attention_lengths", f"attention_lengths must be ints in [1, max_seq_length={S}], got {rungs!r}"
            )
        return tuple(sorted({*rungs, S}))

    @functools.cached_property
    def lane_counts(self) -> tuple[int, ...]:
        """Lanes a mixed step may have: 1, P, then x4 up to the burst lanes (which end it). Empty when
        prompts go in one token per step through the decode rows (no lanes, or a chunk of 1). One lane
        first: a lone prompt (a server's usual arrival) costs a step of B + C rows, not B + P*C."""
        if not self.admit_lanes or self.prefill_chunk == 1:
            return ()
        counts = [1, self.admit_lanes]
        while counts[-1] * 4 < self.burst_lanes:
            counts.append(counts[-1] * 4)
        return tuple(sorted({*counts, self.burst_lanes}))

    @functools.cached_property
    def verify_lane_counts(self) -> tuple[int, ...]:
        """Verify lanes a step may have (one per drafting slot): 1, then x4 up to batch_size (which
        ends it). Empty when speculative decoding is off."""
        if not self.speculative_tokens:
            return ()
        counts = [1]
        while counts[-1] * 4 < self.batch_size:
            counts.append(counts[-1] * 4)
        return tuple(sorted({*counts, self.batch_size}))

    @property
    def step_shapes(self) -> tuple[StepShape, ...]:
        """Every shape the step program is made for, each once, whatever the traffic: a decode-only
        step, a mixed step per lane count and a verify step per verify lane count, at each rung of
        the attention-length ladder."""
        kinds = [(0, False), *((c, False) for c in self.lane_counts), *((c, True) for c in self.verify_lane_counts)]
        return tuple(StepShape(lanes, length, verify) for lanes, verify in kinds for length in self.ladder)

    def lanes_for(self, busy: int) -> int:
        """The lane count of a step with `busy` lanes of prompt work: the smallest that holds them."""
        return next(c for c in self.lane_counts if c >= busy) if busy else 0

    def verify_lanes_for(self, drafting: int) -> int:
        """The verify lane count of a step with `drafting` slots checking drafts: the smallest that holds them."""
        return next(c for c in self.verify_lane_counts if c >= drafting)

    def step_rows(self, lanes: int, verify: bool = False) -> int:
        """N, the rows of a step with this many lanes: B decode rows + lanes * prefill_chunk (verify
        lanes: lanes * (speculative_tokens + 1))."""
        return self.batch_size + lanes * (self.speculative_tokens + 1 if verify else self.prefill_chunk)

    def attention_length(self, span: int) -> int:
        """The smallest rung covering cache entries 0 .. span-1."""
        return next(r for r in self.ladder if r >= span)
