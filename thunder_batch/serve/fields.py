"""A request's errors for the client (APIError: status and OpenAI's error fields) and its typed fields."""

from __future__ import annotations

import json
import math


class APIError(Exception):
    """An error for the client: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        kind = "rate_limit_error" if self.status == 429 else kind
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict:  # crosses the process boundary as plain data
        return dict(status=self.status, message=self.message, param=self.param, code=self.code)


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", dict: "an object"}


def get_field(data: dict, name: str, types, default=None, label: str | None = None):
    """data[name] if present and not null, checked against types (bool is not an int; int is a float)."""
    value = data.get(name)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        wanted = "a number" if float in types else " or ".join(_TYPE_NAMES[t] for t in types)
        raise APIError(
            400, f"'{label or name}' must be {wanted}, got {json.dumps(value)[:80]}", label or name, "invalid_type"
        )
    return value
