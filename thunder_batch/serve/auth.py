"""The one door every HTTP request passes: the API key and the request id (an ASGI middleware).

Every path but /health needs the key when one is set: the OpenAI routes, /stats, /metrics, LitServe's
/info and FastAPI's /docs, /redoc and /openapi.json alike. Every answer carries an X-Request-Id: the
client's own (printable, up to 128 characters) or a fresh one, also in the server's log lines about it.
"""

from __future__ import annotations

import hmac
import json
import uuid

OPEN_PATHS = ("/health",)  # load balancers probe without a key


def check_api_key(headers: dict[str, str], key: str | None) -> bool:
    """True when `key` is None or the headers carry it as a Bearer token (or X-API-Key)."""
    if key is None:
        return True
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
    return hmac.compare_digest(token.encode(), key.encode())


def request_id_from(headers: dict[str, str]) -> str:
    given = headers.get("x-request-id", "")
    return given if 0 < len(given) <= 128 and given.isprintable() and given.isascii() else uuid.uuid4().hex


class APIKeyMiddleware:
    """401 (OpenAI-shaped) without the key, X-Request-Id on every answer."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = request_id_from(headers)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        if scope["path"] in OPEN_PATHS or check_api_key(headers, self.key):
            return await self.app(scope, receive, send_with_id)
        await _unauthorized(send_with_id)


async def _unauthorized(send) -> None:
    error = {
        "message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
