"""Chat messages -> prompt text through litgpt's prompt style for the model, plus its stop tokens."""

from __future__ import annotations

from pathlib import Path

from litgpt.prompts import ChatML, PromptStyle, has_prompt_style, load_prompt_style

ROLES = ("system", "user", "assistant")


def prompt_style_for(config, checkpoint_dir: Path | str | None = None) -> PromptStyle:
    """The checkpoint's own prompt_style.yaml if present, else litgpt's style for the model name."""
    if checkpoint_dir is not None and has_prompt_style(Path(checkpoint_dir)):
        return load_prompt_style(Path(checkpoint_dir))
    return PromptStyle.from_config(config)


def validate_messages(messages) -> list[dict]:
    """ValueError unless messages is a non-empty list of {"role", "content": str} dicts ending with a user turn."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"each chat message needs a role in {ROLES} and a string content; got {m!r}")
    if messages[-1]["role"] != "user":
        raise ValueError("the last chat message must have role 'user'")
    return list(messages)


def apply_chat(style: PromptStyle, messages) -> str:
    """Render messages with the prompt style. ChatML styles take whole conversations; other litgpt
    styles only know one user turn (with an optional system prompt)."""
    messages = validate_messages(messages)
    system = "\n".join(m["content"] for m in messages if m["role"] == "system") or None
    turns = [m for m in messages if m["role"] != "system"]
    if isinstance(style, ChatML):
        system = system or style.system_message
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns)
        return f"{head}{body}<|im_start|>assistant\n"
    if len(turns) != 1:
        raise ValueError(
            f"the {type(style).__name__} prompt style supports a single user turn (plus system), got {len(turns)} turns"
        )
    return style.apply(turns[0]["content"], sys_prompt=system)


def chat_stop_sequences(style: PromptStyle, tokenizer) -> tuple[tuple[int, ...], ...]:
    """Stop token sequences of the style (e.g. <|im_end|> for ChatML), without empty or None entries."""
    stops = []
    for seq in style.stop_tokens(tokenizer):
        ids = tuple(int(t) for t in seq if t is not None)
        if ids:
            stops.append(ids)
    return tuple(stops)
