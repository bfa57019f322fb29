"""The API key check every route but /health runs (LitServe calls it as a dependency of each route)."""

from __future__ import annotations

import hmac

from fastapi import Request

from thunder_batch.serve.openai import APIError


def check_api_key(request: Request, key: str | None) -> None:
    """401 unless the request carries `key` as a Bearer token (or X-API-Key); /health stays open for probes."""
    if key is None or request.url.path == "/health":
        return
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(token.encode(), key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
