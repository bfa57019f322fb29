"""OpenAI-compatible request parsing for `thunder-batch serve` (response bodies: `responses`).

Pure Python (imports no torch, no web framework). The HTTP side parses a request here, once, into
the prompts and a validated SamplingParams before it reaches the inference worker; the worker reports
only the errors that need the tokenizer: the chat template, a prompt too long for the cache, and a schema
or grammar that does not compile (under the request's own field: `ParsedRequest.names`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from thunder_batch.config import MAX_LOGPROBS, ParamError, SamplingParams, is_int
from thunder_batch.serve.fields import APIError, get_field
from thunder_batch.serve.sampling_fields import constraint, logit_controls, request_field, tool_fields
from thunder_batch.tool_calls import tool_prompt

CHAT, COMPLETION = "chat", "completion"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions

# Parameters we do not implement: accepted only at their neutral value, so no client silently
# gets something other than what it asked for.
NEUTRAL = {
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
}


@dataclass
class ParsedRequest:
    """A validated request: what the worker needs, and how to shape the answer. Choice i*n + j is
    the j-th of the `n` answers to prompts[i] (OpenAI's order)."""

    kind: str
    prompts: list  # each a str, a list of token ids, or a list of {"role", "content"} dicts
    params: SamplingParams  # max_new_tokens None: the rest of the cache (the engine resolves it)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    echo: bool = False  # completions: the prompt is part of the text (and its tokens of the logprobs)
    logprobs: bool = False  # shape token logprobs (params.logprobs alternatives each)
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone comes back (its one made token is not sent)
    names: dict | None = None  # SamplingParams field -> the request's own name for it, where they differ
    tool_names: tuple = ()  # chat with tools (tool_choice not "none"): answers are read for calls to these
    user: str | None = None  # OpenAI's end-user id: replicas behind a router keep one user's requests together

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def payload(self) -> dict:
        return dict(
            prompts=self.prompts,
            params=self.params,
            n=self.n,
            echo=self.echo,
            logprobs=self.logprobs,
            echo_only=self.echo_only,
            names=self.names or {},
        )


@dataclass(frozen=True)
class Limits:
    """What one request may ask for: `n` up to max_n (the batch size), prompts x n up to max_choices."""

    max_n: int = 1
    max_choices: int = 1


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


def parse_request(body: bytes, kind: str, limits: Limits = Limits()) -> ParsedRequest:
    """Body of POST /v1/chat/completions (CHAT) or /v1/completions (COMPLETION) -> ParsedRequest, or APIError (400)."""
    data = parse_json(body)
    get_field(data, "model", str)  # any name is accepted: one model is served
    for name, neutral in NEUTRAL.items():
        _check_neutral(data, name, neutral)
    echo = echo_only = False
    tools, grammar = tool_fields(data) if kind == CHAT else ([], None)
    if kind == CHAT:
        prompts = [_plain(_messages(data), tools)]
        max_tokens = get_field(data, "max_completion_tokens", int, get_field(data, "max_tokens", int))
        logprobs = _chat_logprobs(data)
    else:
        prompts = _completion_prompts(data)
        max_tokens = get_field(data, "max_tokens", int, COMPLETION_DEFAULT_MAX_TOKENS)
        logprobs = _count(data, "logprobs", None)
        echo = get_field(data, "echo", bool, False)
        if echo and max_tokens == 0:  # score the prompt only (OpenAI, vLLM): one token is made, not sent
            echo_only, max_tokens = True, 1
    stream = get_field(data, "stream", bool, False)
    options = get_field(data, "stream_options", dict, {})
    include_usage = stream and get_field(options, "include_usage", bool, False, "stream_options.include_usage")
    n = _n(data, len(prompts), limits)
    params = _sampling(data, max_tokens, logprobs, logprobs if echo else None, grammar)
    # A schema the worker cannot compile is reported under the request's own field (response_format, ...).
    names = {params.constraint[0]: request_field(data, params.constraint[0])} if params.constraint else None
    tool_names = tuple(t["function"]["name"] for t in tools)
    logprobs = logprobs is not None
    user = get_field(data, "user", str)
    fields = (stream, include_usage, n, echo, logprobs, echo_only, names, tool_names, user)
    return ParsedRequest(kind, prompts, params, *fields)


def _chat_logprobs(data: dict) -> int | None:
    """Chat: `logprobs: true` returns each token's logprob, `top_logprobs` that many alternatives."""
    top = _count(data, "top_logprobs", None)
    if not get_field(data, "logprobs", bool, False):
        if top is not None:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
        return None
    return top or 0


def _count(data: dict, name: str, default):
    value = get_field(data, name, int, default)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got {value}", name, "invalid_value")
    return value


def _n(data: dict, prompts: int, limits: Limits) -> int:
    n = get_field(data, "n", int, 1)
    if not 1 <= n <= limits.max_n:
        raise APIError(
            400, f"'n' must be an integer in [1, {limits.max_n}] (the batch size), got {n}", "n", "invalid_value"
        )
    if prompts * n > limits.max_choices:
        raise APIError(
            400,
            f"{prompts} prompts x n={n} is {prompts * n} answers; one request may ask for at most "
            f"{limits.max_choices} (a worker's slots and waiting room)",
            "prompt" if prompts > 1 else "n",
            "invalid_value",
        )
    return n


def _sampling(
    data: dict, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None, tool_grammar: str | None
) -> SamplingParams:
    """tool_grammar: the answer's grammar for the request's tools (tool_calls.py), None without."""
    top_k = get_field(data, "top_k", int)
    stop = get_field(data, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise APIError(400, "'stop' must be a string or a list of strings", "stop", "invalid_type")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=get_field(data, "temperature", (int, float), 1.0),
            top_p=get_field(data, "top_p", (int, float), 1.0),
            top_k=None if top_k == -1 else top_k,
            stop=stop,
            seed=get_field(data, "seed", int),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **logit_controls(data),
            **constraint(data, tool_grammar),
        )
    except ParamError as e:  # the client named it max_tokens (or max_completion_tokens)
        param = "max_tokens" if e.param == "max_new_tokens" else e.param
        message = str(e).replace("max_new_tokens", "max_tokens")
        raise APIError(400, message, request_field(data, param), "invalid_value") from None


def _messages(data: dict) -> list[dict]:
    """OpenAI messages -> [{"role", "content": str}] (an assistant turn's `tool_calls` kept, its content then
    optional); roles and order are checked by the engine."""
    messages = get_field(data, "messages", list)
    if not messages:
        raise APIError(
            400, "'messages' is required: a non-empty list of {'role', 'content'} objects", "messages", "invalid_value"
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'", "messages", "invalid_type")
        calls = get_field(m, "tool_calls", list, None, f"messages[{i}].tool_calls")
        calls = calls if m["role"] == "assistant" else None
        content = "" if calls and m.get("content") is None else _content(m.get("content"), i)
        out.append({"role": m["role"], "content": content, **({"tool_calls": calls} if calls else {})})
    return out


def _plain(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages the prompt style renders: tool calls and results as text, the tools in the system message."""
    try:
        return tool_prompt(messages, tools)
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None


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


def _completion_prompts(data: dict) -> list:
    """A string, a list of token ids, or a list of several of either (a batch of prompts)."""
    prompt = get_field(data, "prompt", (str, list))
    batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if batch else [prompt]
    if all((isinstance(p, str) and p) or (isinstance(p, list) and p and all(is_int(t) for t in p)) for p in prompts):
        return prompts
    raise APIError(
        400,
        "'prompt' is required: a non-empty string, a list of token ids, or a list of several of those",
        "prompt",
        "invalid_value",
    )


def _check_neutral(data: dict, name: str, allowed: tuple) -> None:
    value = data.get(name)
    if value is None or any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
        return
    raise APIError(
        400, f"'{name}' is not supported by this server (only {json.dumps(allowed[0])})", name, "unsupported"
    )
