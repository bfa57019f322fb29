"""EngineConfig and SamplingParams: frozen, validated at construction with messages naming the limit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from thunder_batch.stops import normalize_stop

COMPILE_MODES = ("thunder", "eager")
TRACE_MODES = ("layers", "step")
MAX_SEED = 2**63 - 1


class ParamError(ValueError):
    """A setting out of range; `param` names the field, so callers (the server) need not parse the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(ValueError):
    """A prompt and its max_new_tokens do not fit in a slot's cache of max_seq_length tokens.
    max_new_tokens is None when the request asked for the rest of the cache (at least 1 token)."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int | None, max_seq_length: int) -> None:
        wanted = "at least 1" if max_new_tokens is None else max_new_tokens
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({wanted}) exceeds max_seq_length ({max_seq_length})"
        )
        self.prompt_tokens, self.max_new_tokens, self.max_seq_length = prompt_tokens, max_new_tokens, max_seq_length


def is_int(value) -> bool:
    """An int that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value, minimum: int) -> None:
    if not is_int(value) or value < minimum:
        raise ParamError(name, f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Shape of the compiled step: B slots, a cache of `max_seq_length` tokens per slot, and
    step widths T in {prefill_chunk, 1}."""

    batch_size: int = 8
    max_seq_length: int = 1024
    prefill_chunk: int = 64
    compile: str = "thunder"
    executors: tuple[str, ...] | None = None  # None: Thunder's defaults for the device
    cuda_graphs: bool = False
    cache_dir: str | None = None  # compile cache root; None: $THUNDER_BATCH_CACHE_DIR, else ./compile_cache
    # "layers": prefix, blocks and head traced apart, layers sharing block traces (seconds to compile,
    # stored in the compile cache); "step": the whole step as one trace (minutes; in memory only)
    trace: str = "layers"

    def __post_init__(self) -> None:
        _require_int("batch_size", self.batch_size, 1)
        _require_int("max_seq_length", self.max_seq_length, 2)
        _require_int("prefill_chunk", self.prefill_chunk, 1)
        if self.prefill_chunk > self.max_seq_length:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must be <= max_seq_length ({self.max_seq_length})")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {COMPILE_MODES}, got {self.compile!r}")
        if self.trace not in TRACE_MODES:
            raise ValueError(f"trace must be one of {TRACE_MODES}, got {self.trace!r}")
        if self.cuda_graphs and self.compile == "thunder" and self.trace != "step":
            # A captured graph holds its first layer's tensors: layers cannot share it.
            raise ValueError("cuda_graphs=True needs trace='step' (a CUDA graph cannot be shared by layers)")
        if self.executors is not None:
            object.__setattr__(self, "executors", tuple(self.executors))

    @property
    def step_widths(self) -> tuple[int, ...]:
        """The T values the step program is traced for: one trace each, never more."""
        return tuple(sorted({1, self.prefill_chunk}))


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 is greedy; top_k None/0 and top_p 1 are off.
    `stop` takes a string, a list of strings, a token-id list, or a list of token-id lists.
    max_new_tokens None: as many as the slot's cache holds after the prompt (OpenAI's max_tokens left out)."""

    max_new_tokens: int | None = 32
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: object = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_sequences: tuple[tuple[int, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None:
            _require_int("max_new_tokens", self.max_new_tokens, 1)
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ParamError("temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None:
            _require_int("top_k", self.top_k, 0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ParamError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ParamError("seed", f"seed must be None or an int in [0, {MAX_SEED}], got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ParamError(
                "stop_token_ids", f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}"
            )
        try:
            strings, sequences = normalize_stop(self.stop)
        except ValueError as e:
            raise ParamError("stop", str(e)) from None
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", strings)
        object.__setattr__(self, "stop_sequences", sequences)
