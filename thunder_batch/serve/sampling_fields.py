"""The sampling fields of a request beyond OpenAI's basics: the logit controls (OpenAI's penalties and logit_bias,
vLLM's repetition_penalty, min_p, min_tokens) and structured output (OpenAI's response_format and tools, vLLM's
guided_*, llama.cpp's grammar / json_schema), as SamplingParams fields, which check them (logit_controls.py,
constraints.py; tools: tool_calls.py). Pure Python, like `openai`."""

from __future__ import annotations

import json

from thunder_batch.param_error import ParamError
from thunder_batch.serve.fields import APIError, get_field
from thunder_batch.tool_calls import check_tools, tool_grammar


def logit_controls(data: dict) -> dict:
    """OpenAI's penalties and logit_bias (string token ids as keys), and vLLM's repetition_penalty, min_p and
    min_tokens: checked by SamplingParams (logit_controls.py)."""
    number = (int, float)
    controls = dict(
        presence_penalty=get_field(data, "presence_penalty", number, 0.0),
        frequency_penalty=get_field(data, "frequency_penalty", number, 0.0),
        repetition_penalty=get_field(data, "repetition_penalty", number, 1.0),
        min_p=get_field(data, "min_p", number, 0.0),
        min_tokens=get_field(data, "min_tokens", int, 0),
    )
    return dict(controls, logit_bias=get_field(data, "logit_bias", dict, {}))


# Where a request may ask for structured output: vLLM's guided_* and llama.cpp's grammar / json_schema, beside
# OpenAI's response_format -> the SamplingParams field (constraints.py).
CONSTRAINT_FIELDS = {
    "guided_json": "json_schema",
    "json_schema": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "grammar": "grammar",
}


def tool_fields(data: dict) -> tuple[list[dict], str | None]:
    """(tools the prompt describes, the answer's grammar) for OpenAI's tools, tool_choice and parallel_tool_calls;
    ([], None) without tools or with tool_choice "none"."""
    tools, choice = get_field(data, "tools", list, []), data.get("tool_choice")
    parallel = get_field(data, "parallel_tool_calls", bool, True)
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice", "invalid_value")
        return [], None
    try:
        tools, choice = check_tools(tools, "auto" if choice is None else choice)
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None
    return ([], None) if choice == "none" else (tools, tool_grammar(tools, choice, parallel))


def constraint(data: dict, tool_grammar: str | None = None) -> dict:
    """The one constraint a request sets, as SamplingParams fields ({} for none): response_format json_object (any
    JSON object) or json_schema ({"name", "schema", "strict"}), one of CONSTRAINT_FIELDS, or its tools' grammar."""
    given = {name: data[name] for name in CONSTRAINT_FIELDS if data.get(name) is not None}
    if tool_grammar is not None:
        given["tools"] = tool_grammar
    fmt = get_field(data, "response_format", dict)
    kind = None if fmt is None else fmt.get("type")
    if kind not in (None, "text", "json_object", "json_schema"):
        message = f"response_format.type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:40]}"
        raise APIError(400, message, "response_format", "invalid_value")
    if kind in ("json_object", "json_schema"):
        given["response_format"] = _response_schema(fmt) if kind == "json_schema" else {"type": "object"}
    if len(given) > 1:
        raise APIError(400, f"set one of {', '.join(given)}, not several", list(given)[1], "invalid_value")
    fields = dict(CONSTRAINT_FIELDS, tools="grammar")
    return {fields.get(name, "json_schema"): value for name, value in given.items()}


def _response_schema(fmt: dict) -> dict:
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        message = "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}"
        raise APIError(400, message, "response_format", "invalid_value")
    return schema


def request_field(data: dict, param: str) -> str | None:
    """The request's own name for a SamplingParams field it set (response_format or guided_json: json_schema)."""
    if param in data:
        return param
    names = [name for name, field in CONSTRAINT_FIELDS.items() if field == param]
    names += {"json_schema": ["response_format"], "grammar": ["tools"]}.get(param, [])
    return next((name for name in names if data.get(name) is not None), None)
