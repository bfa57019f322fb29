"""OpenAI response bodies for `thunder-batch serve`: full answers, stream chunks, logprobs, usage.

Pure Python. The worker sends each token's logprob entry as [text, logprob, [[text, logprob], ...]]
(its alternatives, most likely first); an echoed prompt's first token has logprob None (nothing comes
before it). Chat gets OpenAI's `logprobs.content`; completions the legacy `tokens`, `token_logprobs`,
`top_logprobs` (the sampled token included, as OpenAI and vLLM do) and `text_offset`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from thunder_batch.serve.openai import CHAT
from thunder_batch.tool_calls import parse_tool_calls, streamable

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class Choice:
    """One answer as it arrives from the worker."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    tokens: list = field(default_factory=list)  # logprob entries, when asked for
    offset: int = 0  # completions: text offset of the next token's logprob entry
    sent: str = ""  # a chat with tools: the content streamed so far (text before a tool call)

    def add(self, message: dict) -> None:
        self.text += message.get("echo", {}).get("text", "") + message.get("text", "")
        self.tokens += message.get("echo", {}).get("logprobs", []) + message.get("logprobs", [])
        if "finish_reason" in message:
            self.finish_reason, self.completion_tokens = message["finish_reason"], message["completion_tokens"]


class ResponseBuilder:
    """OpenAI response objects for one request (chat.completion or text_completion)."""

    def __init__(self, kind: str, request_id: str, model: str, logprobs: bool = False, tool_names: tuple = ()):
        """tool_names: a chat with tools; its answers' tool calls (tool_calls.py) become `tool_calls`."""
        self.kind, self.model, self.created, self.logprobs = kind, model, int(time.time()), logprobs
        self.tool_names = tool_names
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id
        self.object = "chat.completion" if kind == CHAT else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[Choice], usage: dict) -> dict:
        return {**self._head(self.object), "choices": [self._full_choice(c) for c in choices], "usage": usage}

    def _full_choice(self, c: Choice) -> dict:
        logprobs = self._logprobs(c, c.tokens) if self.logprobs else None
        if self.kind == CHAT:
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if self.tool_names:
                content, calls = parse_tool_calls(c.text, self.tool_names)
                message, finish_reason = _with_calls({"role": "assistant", "content": content}, calls, finish_reason)
            return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def chunk(self, choice: Choice, message: dict | None = None, role: bool = False) -> dict:
        """A stream chunk for one choice: its role (chat's first chunk), or one worker message."""
        message = message or {}
        echo = message.get("echo", {})
        text = echo.get("text", "") + message.get("text", "")
        tokens = echo.get("logprobs", []) + message.get("logprobs", [])
        logprobs = self._logprobs(choice, tokens) if self.logprobs and tokens else None
        finish_reason = message.get("finish_reason")
        entry = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.kind == CHAT:
            entry["delta"] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if self.tool_names and not role:
                entry["delta"], entry["finish_reason"] = self._tool_delta(choice, finish_reason)
            return {**self._head("chat.completion.chunk"), "choices": [entry]}
        return {**self._head(self.object), "choices": [{**entry, "text": text}]}

    def _tool_delta(self, choice: Choice, finish_reason: str | None) -> tuple[dict, str | None]:
        """The content that is surely not a tool call, as it comes; the calls (each whole) at the end."""
        if finish_reason is None:
            content = streamable(choice.text)[len(choice.sent) :]
            choice.sent += content
            return ({"content": content} if content else {}), None
        content, calls = parse_tool_calls(choice.text, self.tool_names)
        rest = (content or "")[len(choice.sent) :] if (content or "").startswith(choice.sent) else ""
        delta, finish_reason = _with_calls({"content": rest} if rest else {}, calls, finish_reason)
        for i, call in enumerate(delta.get("tool_calls", [])):
            call["index"] = i
        return delta, finish_reason

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == CHAT else self.object
        return {**self._head(obj), "choices": [], "usage": usage}

    def _logprobs(self, choice: Choice, tokens: list) -> dict:
        if self.kind == CHAT:
            return {"content": [_chat_token(*t) for t in tokens], "refusal": None}
        offsets = []
        for text, *_ in tokens:
            offsets.append(choice.offset)
            choice.offset += len(text)
        return {
            "tokens": [t[0] for t in tokens],
            "token_logprobs": [t[1] for t in tokens],
            "top_logprobs": [None if lp is None else {**dict(top), text: lp} for text, lp, top in tokens],
            "text_offset": offsets,
        }


def _with_calls(message: dict, calls: list[dict], finish_reason: str | None) -> tuple[dict, str | None]:
    """A message with its tool calls, and OpenAI's finish_reason "tool_calls" for an answer that ended in them."""
    if not calls:
        return message, finish_reason
    return {**message, "tool_calls": calls}, ("tool_calls" if finish_reason == "stop" else finish_reason)


def _chat_token(text: str, logprob: float, top: list) -> dict:
    entry = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {**entry, "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]}


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
