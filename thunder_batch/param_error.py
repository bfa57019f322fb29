"""The error a bad setting raises, and the int check the settings share (below config and logit_controls)."""

from __future__ import annotations


class ParamError(ValueError):
    """A setting out of range; `param` names the field, so callers (the server) need not parse the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def is_int(value) -> bool:
    """An int that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
