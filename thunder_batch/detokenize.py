"""Incremental (streaming) detokenization, one instance per request.

Decoding token by token is wrong for two reasons: a multi-byte UTF-8 character can span several
byte-level tokens (each alone decodes to U+FFFD), and some decoders (Llama's Metaspace/Strip,
sentencepiece) drop the leading space of the first token of whatever they decode. Both are
solved by decoding a short window of ids and emitting only the text past the window's prefix,
holding back text that still ends in U+FFFD.

Special tokens are skipped, as litgpt's ``Tokenizer.decode`` does (``tokenizers`` defaults to
``skip_special_tokens=True``; sentencepiece drops control tokens).

Invariant: ``"".join(push(t) for t in ids) + flush() == decode(ids)`` when there is no prompt
context. With ``prompt_ids``, the deltas are instead the continuation of the prompt,
``decode(prompt + ids)[len(decode(prompt)):]``, so the first token keeps its leading space.
For byte-level BPE (GPT-2, Llama 3, Qwen...) both are the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Ids of context kept in front of new tokens: enough for any decoder to see a word boundary and
# for the longest UTF-8 character (4 bytes = at most 4 byte tokens).
_CONTEXT = 6


def _resolve(tokenizer) -> tuple[HFTokenizer | None, Callable[[list[int]], str]]:
    """(HF tokenizer or None, decode(list of ids) -> str) for a litgpt or `tokenizers` tokenizer."""
    processor = getattr(tokenizer, "processor", tokenizer)  # litgpt Tokenizer wraps a processor
    if isinstance(processor, HFTokenizer):
        return processor, lambda ids: processor.decode(ids, skip_special_tokens=True)
    if callable(getattr(processor, "decode", None)):  # sentencepiece, or any decode(list[int])
        return None, lambda ids: processor.decode(list(ids))
    raise TypeError(f"cannot detokenize with {type(tokenizer).__name__}: it has no decode()")


class IncrementalDetokenizer:
    """Per-request streaming decode; never emits U+FFFD for a character split across tokens.

    The `tokenizers` backend uses its Rust ``DecodeStream``; other backends (sentencepiece) use
    the same decode-a-window-and-diff scheme in Python. Call ``flush()`` when the request
    finishes to release tokens still held (a truncated character then shows as U+FFFD, exactly
    as a full decode would show it).
    """

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = ()):
        self._hf, self._decode = _resolve(tokenizer)
        context = [int(t) for t in list(prompt_ids)[-_CONTEXT:]]
        # A prompt that ends mid-character has no well-defined continuation text (and
        # DecodeStream rejects it); decode the generated ids on their own instead.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._context = context  # ids already emitted (or prompt) kept as decoding context
        self._pending: list[int] = []  # ids pushed but whose text is not emitted yet
        self._prefix: str | None = None  # decode(self._context), computed when needed
        self._stream = DecodeStream(context, skip_special_tokens=True) if self._hf else None
        self._parts: list[str] = []

    def push(self, token_id: int) -> str:
        """Feed one generated token id; return the new text (possibly "")."""
        token_id = int(token_id)
        self._pending.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._hf, token_id)
        else:
            delta = self._window_step()
        if delta is None:
            return ""
        self._emitted(delta)
        return delta

    def flush(self) -> str:
        """At finish: the text of tokens still held back (e.g. an incomplete character)."""
        if not self._pending:
            return ""
        delta = self._decode(self._context + self._pending)[len(self._prefix_text()) :]
        self._emitted(delta)
        if self._stream is not None:  # keep the stream usable (and in sync) after a flush
            self._stream = DecodeStream(self._context, skip_special_tokens=True)
        return delta

    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _window_step(self) -> str | None:
        prefix = self._prefix_text()
        full = self._decode(self._context + self._pending)
        # Shorter: only a skipped special token so far; U+FFFD at the end: a character is cut.
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return None
        return full[len(prefix) :]

    def _emitted(self, delta: str) -> None:
        self._parts.append(delta)
        self._context = (self._context + self._pending)[-_CONTEXT:]
        self._pending = []
        self._prefix = None

    def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = self._decode(self._context)
        return self._prefix
