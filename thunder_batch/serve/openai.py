"""OpenAI-compatible request parsing and response shaping for `thunder-batch serve`.

Pure Python (imports no torch, no web framework). The HTTP side parses a request here, once, into
the prompt and a validated SamplingParams before it reaches the inference worker; the worker reports
only prompt-dependent errors (chat template, prompt too long for the cache), which need the
tokenizer. Every response body is shaped here.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

from thunder_batch.config import ParamError, SamplingParams, is_int

CHAT, COMPLETION = "chat", "completion"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
SSE_DONE = "data: [DONE]\n\n"

# Parameters we do not implement: accepted only at their neutral value, so no client silently
# gets something other than what it asked for.
NEUTRAL = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "suffix": ("",),
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "logit_bias": ({},),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}


class APIError(Exception):
    """An error for the client: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def to_dict(self) -> dict:  # crosses the process boundary as plain data
        return dict(status=self.status, message=self.message, param=self.param, code=self.code)


@dataclass
class Job:
    """A validated request: what the worker needs, and how to shape the answer."""

    kind: str
    prompt: object  # str | list[int] | list of {"role", "content"} dicts
    params: SamplingParams  # max_new_tokens None: the rest of the cache (the engine resolves it)
    stream: bool = False
    include_usage: bool = False

    def payload(self) -> dict:
        return {"prompt": self.prompt, "params": self.params}


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"the request body is not valid UTF-8 JSON: {e}", code="invalid_json") from None
    except RecursionError:  # e.g. [[[...]]] thousands deep: a client error, not a 500
        raise APIError(400, "the request body nests too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def parse_request(body: bytes, kind: str) -> Job:
    """Body of POST /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) -> Job, or APIError (400)."""
    data = parse_json(body)
    _get(data, "model", str)  # any name is accepted: one model is served
    for name, neutral in NEUTRAL.items():
        _check_neutral(data, name, neutral)
    if kind == CHAT:
        prompt = _messages(data)
        max_tokens = _get(data, "max_completion_tokens", int, _get(data, "max_tokens", int))
    else:
        prompt = _completion_prompt(data)
        max_tokens = _get(data, "max_tokens", int, COMPLETION_DEFAULT_MAX_TOKENS)
    stream = _get(data, "stream", bool, False)
    options = _get(data, "stream_options", dict, {})
    include_usage = stream and _get(options, "include_usage", bool, False, "stream_options.include_usage")
    return Job(kind, prompt, _sampling(data, max_tokens), stream, include_usage)


def _sampling(data: dict, max_tokens: int | None) -> SamplingParams:
    top_k = _get(data, "top_k", int)
    stop = _get(data, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=_get(data, "temperature", (int, float), 1.0),
            top_p=_get(data, "top_p", (int, float), 1.0),
            top_k=None if top_k == -1 else top_k,
            stop=stop,
            seed=_get(data, "seed", int),
        )
    except ParamError as e:  # the client named it max_tokens (or max_completion_tokens)
        param = "max_tokens" if e.param == "max_new_tokens" else e.param
        message = str(e).replace("max_new_tokens", "max_tokens")
        raise APIError(400, message, param if param in data else None, "invalid_value") from None


def _messages(data: dict) -> list[dict]:
    """OpenAI messages -> [{"role", "content": str}]; roles and order are checked by the engine."""
    messages = _get(data, "messages", list)
    if not messages:
        raise APIError(
            400, "'messages' is required: a non-empty list of {'role', 'content'} objects", "messages", "invalid_value"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages", "invalid_type")
        out.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return out


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(
        400,
        f"messages[{i}].content must be a string or a list of text parts (only text is supported)",
        "messages",
        "invalid_type",
    )


def _completion_prompt(data: dict):
    """One prompt: a string or a list of token ids (a one-element batch of either is unwrapped)."""
    prompt = _get(data, "prompt", (str, list))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    raise APIError(
        400,
        "'prompt' is required: a non-empty string or list of token ids (one prompt per request)",
        "prompt",
        "invalid_value",
    )


_TYPE_NAMES = {str: "a string", int: "an integer", bool: "a boolean", list: "an array", dict: "an object"}


def _get(data: dict, name: str, types, default=None, label: str | None = None):
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


def _check_neutral(data: dict, name: str, allowed: tuple) -> None:
    value = data.get(name)
    if value is None or any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return
    raise APIError(
        400, f"'{name}' is not supported by this server (only {json.dumps(allowed[0])})", name, "unsupported"
    )


class Shaper:
    """OpenAI response objects for one request (chat.completion or text_completion)."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.kind, self.model, self.created = kind, model, int(time.time())
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id
        self.object = "chat.completion" if kind == CHAT else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.kind == CHAT:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head(self.object), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == CHAT else self.object
        return {**self._head(obj), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def models_list(model: str, created: int) -> dict:
    entry = {"id": model, "object": "model", "created": created, "owned_by": "thunder_batch"}
    return {"object": "list", "data": [entry]}
