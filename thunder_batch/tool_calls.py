"""Tool calls in the Hermes / Qwen2.5 format: the tools go into the system prompt, each call comes back as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, each result goes in as a user turn's
`<tool_response>...</tool_response>`. The prompt styles (chat.py) render plain messages, so this module turns
OpenAI's tool messages into plain ones, makes the grammar that keeps calls valid, and reads calls back.

tool_choice: "auto" lets the model write text, and constrains only what follows a `<tool_call>` it writes (a lazy
grammar, as llama.cpp's); "required" (or "parallel_tool_calls": False) and a named function constrain the whole
answer to calls; "none" leaves the tools out of the prompt. Pure Python: the server and the Python API share it.
"""

from __future__ import annotations

import json
import re
import uuid

from thunder_batch.param_error import ParamError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


def check_tools(tools, tool_choice="auto") -> tuple[list[dict], str]:
    """(tools, choice): OpenAI's function tools checked; choice is "none", "auto", "required" or a tool's name.
    ParamError naming the problem otherwise."""
    if not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools):
        message = "tools must be a list of {'type': 'function', 'function': {'name', 'description', 'parameters'}}"
        raise ParamError("tools", message)
    for t in tools:
        name = t["function"]["name"]
        if not NAME.fullmatch(name):
            raise ParamError("tools", f"a tool's name must be 1-64 letters, digits, '_', '.' or '-', got {name!r:.80}")
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ParamError("tools", f"tool names must be unique, got {names}")
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        if tool_choice not in names:
            raise ParamError("tool_choice", f"tool_choice must name one of the tools {names}, got {tool_choice!r:.80}")
    elif tool_choice not in CHOICES:
        raise ParamError("tool_choice", f"tool_choice must be one of {CHOICES} or a function, got {tool_choice!r:.80}")
    return tools, tool_choice


def _is_function_tool(tool) -> bool:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and isinstance(function.get("description", ""), str)
        and isinstance(function.get("parameters", {}), dict)
    )


def tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """OpenAI messages (assistant turns with `tool_calls`, `tool` turns with results) -> plain {"role",
    "content"} messages, the tools (if any) described in the system message."""
    plain: list[dict] = []
    for m in messages:
        if m.get("role") == "tool":
            response = f"<tool_response>\n{m.get('content')}\n</tool_response>"
            if plain and plain[-1].get("tool_response"):  # one user turn holds consecutive results
                plain[-1]["content"] += "\n" + response
            else:
                plain.append({"role": "user", "content": response, "tool_response": True})
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            plain.append({"role": "assistant", "content": "\n".join(filter(None, [m.get("content"), calls]))})
        else:
            plain.append(dict(m))
    plain = [{"role": m["role"], "content": m["content"]} for m in plain]
    return _with_tools(plain, tools) if tools else plain


def _call_text(call: dict) -> str:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ParamError("messages", f"a tool call needs {{'function': {{'name', 'arguments'}}}}, got {call!r:.80}")
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ParamError("messages", f"a tool call's arguments are not JSON: {arguments!r:.80}") from None
    return f"{OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CLOSE}"


def _with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    described = SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


def tool_grammar(tools: list[dict], choice: str, parallel: bool = True) -> str | None:
    """The Lark grammar (llguidance) of an answer for tool_choice `choice` (None for "none"): every call names a
    tool and its arguments follow that tool's parameters schema."""
    if choice == "none":
        return None
    chosen = [t for t in tools if choice in ("auto", "required") or t["function"]["name"] == choice]
    call = f'"\\n" %json {json.dumps(_call_schema(chosen))} "\\n{CLOSE}"'
    if choice == "auto":  # free text; a call is constrained from the moment the model writes OPEN
        return f'start: call* TEXT\ncall_open[lazy]: TEXT "{OPEN}"\ncall: call_open {call}\nTEXT: /(.|\\n)*/\n'
    many = '("\\n" call)*' if parallel and choice == "required" else ""
    return f'start: call {many}\ncall: "{OPEN}" {call}\n'


def _call_schema(tools: list[dict]) -> dict:
    def one(tool: dict) -> dict:
        function = tool["function"]
        arguments = function.get("parameters") or {"type": "object"}
        properties = {"name": {"const": function["name"]}, "arguments": arguments}
        return {"type": "object", "properties": properties, "required": ["name", "arguments"]}

    return {"anyOf": [one(t) for t in tools], "x-guidance": JSON_STYLE}


def parse_tool_calls(text: str, names) -> tuple[str | None, list[dict]]:
    """(content, calls) of an answer: each `<tool_call>` block that holds a JSON object naming one of `names` with
    object arguments is a call (OpenAI's shape, arguments as JSON text); the rest of the text, stripped, is the
    content (None when empty). A block that is not such a call stays in the content."""
    calls, kept, end = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is not None:
            calls.append(call)
            kept.append(text[end : match.start()])
            end = match.end()
    content = ("".join(kept) + text[end:]).strip()
    return content or None, calls


def _call(body: str, names) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    function = {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def streamable(text: str) -> str:
    """The part of an answer so far that is surely content: the text before its first `<tool_call>` (or before an
    unfinished one at its end), stripped. It only grows as the text does, so a stream sends its new part."""
    cut = text.find(OPEN)
    if cut < 0:
        cut = next((i for i in range(max(0, len(text) - len(OPEN) + 1), len(text)) if OPEN.startswith(text[i:])), None)
    return text[:cut].strip()
