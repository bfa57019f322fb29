"""The logit controls a request may set beside temperature / top-k / top-p, checked with messages naming the
limit. What each does, in the order the step applies them (vLLM's; `sampler.apply_controls`, `sampler.min_p_mask`):

- `min_tokens`: EOS and `stop_token_ids` cannot be sampled before this many tokens (stop strings still stop);
- `logit_bias`: {token id: value in [-100, 100]} added to those logits (OpenAI's; -100 all but bans a token);
- `repetition_penalty` r > 0: every token seen in the prompt or the output has a positive logit divided by r,
  a negative one multiplied by r (the Hugging Face / vLLM rule; 1 = off);
- `frequency_penalty` f, `presence_penalty` p in [-2, 2]: f x (times the token was generated) and p x (whether
  it was) subtracted (OpenAI's; output tokens only);
- then temperature, and `min_p` in [0, 1]: tokens less likely than min_p x the most likely one's probability
  are dropped before top-k / top-p (sampled rows; greedy picks the most likely anyway).

Logprobs stay those of the model's own logits (vLLM's default): the controls steer the choice, not the report
(a grammar's mask is the one exception: a constrained token's logprob is the masked distribution's).
"""

from __future__ import annotations

import math

from thunder_batch.param_error import ParamError, is_int

MAX_PENALTY = 2.0  # OpenAI's bound on the presence and frequency penalties
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value
NEUTRAL = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0, min_tokens=0)


def check_controls(params) -> tuple[tuple[int, float], ...]:
    """Check a SamplingParams' controls (raises config.ParamError); returns its logit_bias as sorted pairs."""
    for name in ("presence_penalty", "frequency_penalty"):
        _require_number(name, getattr(params, name), -MAX_PENALTY, MAX_PENALTY)
    _require_number("min_p", params.min_p, 0.0, 1.0)
    rep = params.repetition_penalty
    _require_number("repetition_penalty", rep, 0.0, MAX_REPETITION_PENALTY)
    if rep <= 0:
        raise ParamError("repetition_penalty", f"repetition_penalty must be > 0 (1 = off), got {rep!r}")
    if not is_int(params.min_tokens) or params.min_tokens < 0:
        raise ParamError("min_tokens", f"min_tokens must be an int >= 0, got {params.min_tokens!r}")
    if params.max_new_tokens is not None and params.min_tokens > params.max_new_tokens:
        message = f"min_tokens ({params.min_tokens}) must be <= max_new_tokens ({params.max_new_tokens})"
        raise ParamError("min_tokens", message)
    return _bias_pairs(params.logit_bias)


def _require_number(name: str, value, low: float, high: float, label: str | None = None) -> None:
    label = label or name
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ParamError(name, f"{label} must be a number in [{low:g}, {high:g}], got {value!r}")
    if not math.isfinite(value):
        raise ParamError(name, f"{label} must be finite, got {value!r}")


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as ((token id, value), ...) sorted by id, from a mapping or pairs; None or empty: ()."""
    if not bias:
        return ()
    try:
        items = list(bias.items() if hasattr(bias, "items") else bias)
        pairs = {int(k) if isinstance(k, str) and k.strip().isdigit() else k: v for k, v in items}
    except (TypeError, ValueError):
        raise ParamError("logit_bias", f"logit_bias must map token ids to numbers, got {str(bias)[:80]}") from None
    for token, value in pairs.items():
        if not is_int(token) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        _require_number("logit_bias", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, f"logit_bias[{token}]")
    return tuple(sorted((int(k), float(v)) for k, v in pairs.items()))


def has_controls(params) -> bool:
    """Whether a request sets any control (a constraint too: constraints.py): its steps then take the heads that
    apply them."""
    if params.logit_bias or params.constraint is not None:
        return True
    return any(getattr(params, name) != value for name, value in NEUTRAL.items())
