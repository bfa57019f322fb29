"""Prompts in: each validated and encoded once, its params fitted to a slot, before any step (pure Python).
Bad input raises ValueError (ContextLengthError for length) naming the limit; nothing is queued."""

from __future__ import annotations

import dataclasses

from thunder_batch.chat import apply_chat, chat_stop_sequences
from thunder_batch.config import ContextLengthError, ParamError, SamplingParams, is_chat, is_int
from thunder_batch.text_encoding import text_encoder


class PromptIntake:
    """The engine's door for prompts: max_seq_length, the tokenizer (or None: token ids only), the prompt
    style for chat messages, and the vocabulary size that ids must fall in."""

    def __init__(self, max_seq_length: int, tokenizer, prompt_style, vocab_size: int) -> None:
        self.max_seq_length, self.tokenizer, self.prompt_style = max_seq_length, tokenizer, prompt_style
        self.vocab_size = vocab_size
        self._longest_token: int | None = None  # characters in the longest vocabulary entry (0: unknown)

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a str or chat messages (both need a tokenizer), or a non-empty list
        of ids in the vocabulary. Text is encoded as Hugging Face's tokenizer for the checkpoint does
        (text_encoding); chat messages through litgpt's prompt style and tokenizer, as before."""
        chat = is_chat(prompt)
        if chat:
            if self.tokenizer is None:
                raise ValueError("chat messages need a tokenizer")
            prompt = apply_chat(self.prompt_style, prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or give the Engine a tokenizer")
            if not prompt:
                raise ValueError("prompt is empty")
            self._check_text_length(prompt)
            try:
                ids = self.tokenizer.encode(prompt).tolist() if chat else text_encoder(self.tokenizer).encode(prompt)
                return [int(t) for t in ids]
            except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
                raise ValueError(f"the tokenizer cannot encode this prompt: {e}") from e
        if not isinstance(prompt, (list, tuple)) or not all(is_int(t) for t in prompt):
            raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return list(prompt)

    def _check_text_length(self, text: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit: a token covers at most as many
        characters as its longest vocabulary entry, so longer text has more tokens than a slot holds."""
        if self._longest_token is None:
            self._longest_token = longest_token_chars(self.tokenizer)
        limit = self.max_seq_length
        if self._longest_token and len(text) > limit * self._longest_token:
            raise ContextLengthError(len(text) // self._longest_token, None, limit, at_least=True)

    def with_chat_stops(self, params: SamplingParams) -> SamplingParams:
        """Chat replies end at the prompt style's stop tokens (e.g. <|im_end|>) as well."""
        strings, sequences = params.stop_strings, params.stop_sequences
        chat = tuple(s for s in chat_stop_sequences(self.prompt_style, self.tokenizer) if s not in sequences)
        return dataclasses.replace(params, stop=[*strings, *(list(s) for s in sequences + chat)])

    def fitted(self, prompt_len: int, params: SamplingParams) -> SamplingParams:
        """params with max_new_tokens None resolved to the rest of the cache; ContextLengthError if it cannot fit.
        Its logit_bias must name tokens of the vocabulary."""
        outside = [t for t, _ in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise ParamError("logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size}); got {outside[:5]}")
        limit, wanted = self.max_seq_length, params.max_new_tokens
        if prompt_len + (wanted or 1) > limit:
            raise ContextLengthError(prompt_len, wanted, limit)
        return params if wanted is not None else dataclasses.replace(params, max_new_tokens=limit - prompt_len)


def longest_token_chars(tokenizer) -> int:
    """Characters of the longest vocabulary entry of a litgpt (or `tokenizers`) tokenizer; 0 if unknown."""
    processor = getattr(tokenizer, "processor", tokenizer)
    if hasattr(processor, "get_vocab"):  # tokenizers.Tokenizer
        return max((len(t) for t in processor.get_vocab(with_added_tokens=True)), default=0)
    if hasattr(processor, "id_to_piece"):  # sentencepiece
        return max((len(processor.id_to_piece(i)) for i in range(processor.get_piece_size())), default=0)
    return 0
