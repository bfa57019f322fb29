"""The error a bad setting raises, and the checks settings share (below config, sampling_params, logit_controls)."""

from __future__ import annotations


class ParamError(ValueError):
    """A setting out of range; `param` names the field, so callers (the server) need not parse the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def is_int(value) -> bool:
    """An int that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        most = "" if maximum is None else f" and <= {maximum}"
        raise ParamError(name, f"{name} must be an int >= {minimum}{most}, got {short_repr(value)}")


def short_repr(value) -> str:
    """repr of a value, cut for a message (a 400-digit number stays readable)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
