"""Output that follows a JSON schema, a regex, a grammar or a list of choices (structured output), with llguidance.

A request sets at most one of SamplingParams' `json_schema` (a dict or its JSON text), `regex`, `grammar` (Lark,
llguidance's own syntax, or llama.cpp's GBNF: a grammar with `::=` rules) and `choice` (strings). The engine
compiles it when the request is prepared (a bad one raises ParamError naming the problem, before any step) into
a per-request `Constraint`: before each step it gives the row's allowed tokens as a bitmask (int32 words, bit
t of word t // 32 for token t; the step's `controlled_` head sets every other logit to -inf), after it takes the
sampled tokens. EOS and the request's stop tokens are allowed exactly when the grammar accepts the text so far.
JSON is compact (", " and ": " separators, no free whitespace): a small model cannot loop on blank lines.
Chosen over xgrammar (benchmarks/grammar_libraries.py, RESULTS.md): one small wheel with no dependencies, an
error for the schema keywords it does not implement where xgrammar ignores some silently, masks of ~15 us a row at
the median (0.2-0.6 ms on bounded strings).
"""

from __future__ import annotations

import functools
import json

from thunder_batch.param_error import ParamError

KINDS = ("json_schema", "regex", "grammar", "choice")
MAX_CHOICES = 4096
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def normalize_constraint(params) -> tuple[str, str] | None:
    """(kind, text) of the one constraint a SamplingParams sets (text: canonical JSON for a schema or choices),
    or None. ParamError when several are set or one is malformed; the grammar itself is checked at compile."""
    given = [kind for kind in KINDS if getattr(params, kind) is not None]
    if len(given) > 1:
        raise ParamError(given[1], f"set at most one of {', '.join(KINDS)}; got {', '.join(given)}")
    if not given:
        return None
    kind, value = given[0], getattr(params, given[0])
    if kind == "json_schema":
        return kind, _schema_text(value)
    if kind == "choice":
        ok = isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_CHOICES
        if not ok or not all(isinstance(c, str) and c for c in value):
            raise ParamError(kind, f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings, got {value!r:.80}")
        return kind, json.dumps(list(value))
    if not isinstance(value, str) or not value:
        raise ParamError(kind, f"{kind} must be a non-empty string, got {value!r:.80}")
    return kind, value


def kept_value(kind: str, text: str):
    """How SamplingParams keeps a constraint's value (hashable, equal for equal schemas): choices as a tuple, the
    rest as text."""
    return tuple(json.loads(text)) if kind == "choice" else text


def _schema_text(value) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ParamError("json_schema", f"json_schema is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ParamError("json_schema", f"json_schema must be a JSON object, got {type(value).__name__}")
    return json.dumps(value, sort_keys=True)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (a Hugging Face `tokenizers.Tokenizer`, as litgpt's Tokenizer holds).
    eos_id: the token that ends a text the grammar accepts; vocab_size: the model's (padded) vocabulary."""

    def __init__(self, tokenizer, eos_id: int, vocab_size: int) -> None:
        import llguidance

        processor = getattr(tokenizer, "processor", tokenizer)
        if not hasattr(processor, "to_str"):
            raise ParamError("json_schema", "structured output needs the model's Hugging Face tokenizer.json")
        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(processor.to_str(), eos_token=eos_id)
        self.vocab_size = vocab_size

    def constraint(self, kind: str, text: str, stop_ids) -> Constraint:
        """A fresh Constraint for one request; ParamError naming the problem for a bad schema or grammar."""
        matcher = self._llg.LLMatcher(self.tokenizer, self._checked(kind, text))
        stops = [t for t in stop_ids if t < self.vocab_size]
        return Constraint(matcher, stops, self.tokenizer.vocab_size, self.vocab_size)

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one compiler per engine, kept as long as it)
    def _checked(self, kind: str, text: str) -> str:
        try:
            grammar = self._grammar(kind, text)
        except ValueError as e:  # llguidance's GBNF converter raises; the rest report through validate_grammar
            raise ParamError(kind, f"invalid {kind}: {e}") from None
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ParamError(kind, f"invalid {kind}: {error.strip()[:500]}")
        return grammar

    def _grammar(self, kind: str, text: str) -> str:
        if kind == "json_schema":
            return self._llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_STYLE)
        if kind == "grammar":
            return self._llg.grammar_from("gbnf" if "::=" in text else "lark", text)
        return self._llg.grammar_from(kind, text)


class Constraint:
    """One request's grammar state: the allowed tokens now (`fill`), the output tokens it has taken (`advance`),
    the tokens it alone allows next (`forced`)."""

    def __init__(self, matcher, stop_ids, tokenizer_vocab: int, model_vocab: int) -> None:
        """The mask's bits past the smaller of the two vocabularies stay 0."""
        import numpy as np

        self.matcher, self.stop_ids = matcher, frozenset(stop_ids)
        self._row = np.zeros((1, -(-tokenizer_vocab // 32)), dtype=np.int32)  # llguidance's row
        self._words = -(-min(tokenizer_vocab, model_vocab) // 32)
        self._model_vocab = model_vocab
        self.taken = 0  # output tokens taken so far
        self._fresh = False  # _row holds the allowed tokens of the state now

    def advance(self, output_ids: list[int]) -> None:
        """Take the request's output tokens not taken yet (a stop token ends the request: nothing to take)."""
        for token in output_ids[self.taken :]:
            if token not in self.stop_ids:
                self.matcher.consume_token(token)  # masked: always allowed; a refusal leaves it in error (fill)
                self._fresh = False
        self.taken = max(self.taken, len(output_ids))

    def forced(self, output_ids: list[int], limit: int, least: int = 1) -> list[int]:
        """After taking output_ids: up to `limit` tokens that are, one after another, the only token the grammar
        allows (a stop token never: the grammar does not accept there), taken too; none (and none taken) when
        there are fewer than `least`. Sampling would give each of them whatever the logits (a masked head leaves
        one finite logit), so they can be fed without sampling."""
        self.advance(output_ids)
        tokens, first = [], None
        while len(tokens) < limit and not (self.matcher.is_error() or self.matcher.is_accepting()):
            token = self._only_token()
            if token is None or token >= self._model_vocab:
                break
            first = self._row.copy() if first is None else first  # the mask of the state before them
            self.matcher.consume_token(token)
            self._fresh = False
            tokens.append(token)
        if len(tokens) < least:
            if tokens:  # back to the state before them, and its mask
                self.matcher.rollback(len(tokens))
                self._row[:], self._fresh = first, True
            return []
        self.taken += len(tokens)
        return tokens

    def _only_token(self) -> int | None:
        """The one token the grammar allows now, or None where it allows several."""
        import numpy as np

        words = self._allowed()[0]
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return None
        word = int(words[nonzero[0]]) & 0xFFFFFFFF
        return int(nonzero[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None

    def _allowed(self):
        if not self._fresh:
            import llguidance.numpy as lnp

            lnp.fill_next_token_bitmask(self.matcher, self._row, 0)
            self._fresh = True
        return self._row

    def fill(self, row) -> None:
        """Write the allowed tokens into row ([words] int32, numpy): the grammar's next tokens, and the stop tokens
        when it accepts the text so far. A matcher in error allows only the stop tokens: the request ends."""
        row[:] = 0
        if not self.matcher.is_error():
            words = min(self._words, row.shape[0], self._row.shape[1])
            row[:words] = self._allowed()[0, :words]
        if self.matcher.is_error() or self.matcher.is_accepting():
            for token in self.stop_ids:
                row[token >> 5] |= _bit(token & 31)


def _bit(k: int) -> int:
    """1 << k as an int32 value (bit 31 is the sign bit)."""
    return (1 << k) - (1 << 32) if k == 31 else 1 << k
