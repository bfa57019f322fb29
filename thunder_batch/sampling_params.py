"""SamplingParams: a request's decoding settings, frozen, validated at construction with messages naming the limit."""

from __future__ import annotations

from dataclasses import dataclass, field

from thunder_batch.constraints import kept_value, normalize_constraint
from thunder_batch.logit_controls import check_controls
from thunder_batch.param_error import ParamError, is_int, require_int, short_repr
from thunder_batch.stops import normalize_stop

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token a step can return (OpenAI's top_logprobs limit)
MAX_INT64 = 2**63 - 1  # integers the step's int64 tensors hold (top_k above the vocabulary is "off")
MAX_TEMPERATURE = 100.0  # past this the logits are flat in float32 anyway
MAX_STOPS = 64  # stop strings and stop token sequences per request
MAX_STOP_LENGTH = 4096  # characters of a stop string, tokens of a stop sequence
_MASK64 = 2**64 - 1


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


def _check_stops(strings: tuple, sequences: tuple) -> None:
    if len(strings) + len(sequences) > MAX_STOPS:
        raise ParamError("stop", f"at most {MAX_STOPS} stops per request, got {len(strings) + len(sequences)}")
    longest = max([len(s) for s in strings] + [len(s) for s in sequences], default=0)
    if longest > MAX_STOP_LENGTH:
        raise ParamError("stop", f"a stop may be at most {MAX_STOP_LENGTH} characters (or tokens) long, got {longest}")


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
            require_int("max_new_tokens", self.max_new_tokens, 1, MAX_INT64)
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ParamError("temperature", f"temperature must be a number, got {short_repr(temperature)}")
        if not 0 <= temperature <= MAX_TEMPERATURE:  # compared as Python numbers: a huge int is no overflow
            message = (
                f"temperature must be a finite number >= 0 and <= {MAX_TEMPERATURE:g}, got {short_repr(temperature)}"
            )
            raise ParamError("temperature", message)
        if self.top_k is not None:
            require_int("top_k", self.top_k, 0, MAX_INT64)
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
