"""EngineConfig and SamplingParams: frozen, validated at construction with messages naming the limit."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from thunder_batch.constraints import kept_value, normalize_constraint
from thunder_batch.logit_controls import check_controls
from thunder_batch.param_error import ParamError, is_int
from thunder_batch.stops import normalize_stop

COMPILE_MODES = ("thunder", "eager")
# GGUF formats a float32 model can be quantized to as it loads (quantized.py; the `gguf` package makes them).
QUANTIZATIONS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
TRACE_MODES = ("layers", "step")
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token a step can return (OpenAI's top_logprobs limit)
MAX_INT64 = 2**63 - 1  # integers the step's int64 tensors hold (top_k above the vocabulary is "off")
MAX_TEMPERATURE = 100.0  # past this the logits are flat in float32 anyway
MAX_STOPS = 64  # stop strings and stop token sequences per request
MAX_STOP_LENGTH = 4096  # characters of a stop string, tokens of a stop sequence
_MASK64 = 2**64 - 1


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


def choice_seed(seed: int, choice: int) -> int:
    """The RNG seed of choice `choice` of a request whose seed is `seed` (0 <= seed <= MAX_SEED): the
    seed itself for choice 0 (so choice 0 of n is the request alone), else a splitmix64 hash of
    (seed, choice) taken into the negative int64 half, which no client seed can reach."""
    if choice == 0:
        return seed
    z = ((seed ^ (choice * 0x9E3779B97F4A7C15 & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return -1 - ((z ^ (z >> 31)) >> 1)  # in [-2**63, -1]


def _as_tuple(value):
    """Lists (from JSON or a CLI) as tuples, so the config stays hashable; anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


def _require_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        most = "" if maximum is None else f" and <= {maximum}"
        raise ParamError(name, f"{name} must be an int >= {minimum}{most}, got {_short(value)}")


def _short(value) -> str:
    """repr of a value, cut for a message (a 400-digit number stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def _check_stops(strings: tuple, sequences: tuple) -> None:
    if len(strings) + len(sequences) > MAX_STOPS:
        raise ParamError("stop", f"at most {MAX_STOPS} stops per request, got {len(strings) + len(sequences)}")
    longest = max([len(s) for s in strings] + [len(s) for s in sequences], default=0)
    if longest > MAX_STOP_LENGTH:
        raise ParamError("stop", f"a stop may be at most {MAX_STOP_LENGTH} characters (or tokens) long, got {longest}")


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
    # Block linears and head as GGUF quantized blocks of this format (quantized.QUANTIZABLE: q8_0 ... q5_1),
    # made from the model's float32 weights when the engine is built (the model is changed in place); None: as
    # loaded (a GGUF file's quantized linears stay quantized either way). float32 activations, CPU.
    quantization: str | None = None

    def __post_init__(self) -> None:
        _require_int("batch_size", self.batch_size, 1)
        _require_int("max_seq_length", self.max_seq_length, 2)
        _require_int("prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_chunk > self.max_seq_length:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must be <= max_seq_length ({self.max_seq_length})")
        self._check_lanes()
        if self.attention_lengths is not None:
            object.__setattr__(self, "attention_lengths", _as_tuple(self.attention_lengths))
        self.ladder  # noqa: B018  (validates the rungs)
        if not isinstance(self.prefix_reuse, bool):
            raise ParamError("prefix_reuse", f"prefix_reuse must be True or False, got {self.prefix_reuse!r}")
        _require_int("prefix_copy_min", self.prefix_copy_min, 1)
        _require_int("prefix_store_mb", self.prefix_store_mb, 0)
        self._check_speculative()
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            choices = ", ".join(QUANTIZATIONS)
            raise ParamError("quantization", f"quantization must be one of {choices}; got {self.quantization!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {TRACE_MODES}, got {self.trace!r}")
        if self.executors is not None:
            object.__setattr__(self, "executors", tuple(self.executors))

    # Fields stay as given (None: a default that follows the other fields, also after dataclasses.replace);
    # the properties below resolve them.
    def _check_lanes(self) -> None:
        _require_int("prefill_lanes", self.admit_lanes, 0)
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
        _require_int("speculative_tokens", self.speculative_tokens, 0)
        if self.speculative_tokens >= self.prefill_chunk:  # a verify lane's pads use a prefill lane's scratch
            message = f"speculative_tokens ({self.speculative_tokens}) must be < prefill_chunk ({self.prefill_chunk})"
            raise ParamError("speculative_tokens", message)
        _require_int("speculative_ngram_min", self.speculative_ngram_min, 1)
        _require_int("speculative_ngram_max", self.speculative_ngram_max, self.speculative_ngram_min)

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


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy; top_k None/0 and top_p 1 are off.
    `stop` takes a string, a list of strings, a token-id list, or a list of token-id lists; stop strings
    need the engine's tokenizer. max_new_tokens None: as many as the slot's cache holds after the prompt
    (OpenAI's max_tokens left out). Every token's logprob (log_softmax of the raw logits) is kept;
    `logprobs` k also keeps the k most likely alternatives at each generated token, `prompt_logprobs`
    k scores the prompt's own tokens (each given those before it) with k alternatives (0 <= k <= 20).
    Penalties, min_p, min_tokens and logit_bias: see `logit_controls`."""

    max_new_tokens: int | None = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: object = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logit controls (logit_controls.py): off at these values.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: object = None  # {token id: bias}; kept as ((id, bias), ...) sorted
    # Structured output (constraints.py), at most one: a JSON schema (dict or JSON text; kept as canonical
    # JSON text), a regex, a grammar (Lark or GBNF), or choices (kept as a tuple).
    json_schema: object = None
    regex: str | None = None
    grammar: str | None = None
    choice: object = None
    constraint: tuple[str, str] | None = field(init=False, repr=False)  # (kind, text) or None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_sequences: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            _require_int("max_new_tokens", self.max_new_tokens, 1, MAX_INT64)
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ParamError("temperature", f"temperature must be a number, got {_short(temperature)}")
        if not 0 <= temperature <= MAX_TEMPERATURE:  # compared as Python numbers: a huge int is no overflow
            message = f"temperature must be a finite number >= 0 and <= {MAX_TEMPERATURE:g}, got {_short(temperature)}"
            raise ParamError("temperature", message)
        if self.top_k is not None:
            _require_int("top_k", self.top_k, 0, MAX_INT64)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ParamError("seed", f"seed must be None or an int in [0, {MAX_SEED}], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ParamError(name, f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ParamError(
                "stop_token_ids", f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}"
            )
        try:
            strings, sequences = normalize_stop(self.stop)
        except ValueError as e:
            raise ParamError("stop", str(e)) from None
        _check_stops(strings, sequences)
        object.__setattr__(self, "logit_bias", check_controls(self))
        object.__setattr__(self, "constraint", normalize_constraint(self))
        if self.constraint is not None:  # hashable, and equal for equal schemas
            object.__setattr__(self, self.constraint[0], kept_value(*self.constraint))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", strings)
        object.__setattr__(self, "stop_sequences", sequences)
