"""Token texts for logprob entries and echoed prompts (the worker side; pure Python)."""

from __future__ import annotations


class TokenTexts:
    """Each token's own text, decoded once per id, and the entries `responses` turns into OpenAI logprobs:
    [text, logprob, [[text, logprob], ...]] per token."""

    def __init__(self, tokenizer) -> None:
        self.processor = getattr(tokenizer, "processor", tokenizer)
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._decode_one(token_id)
        return text

    def _decode_one(self, token_id: int) -> str:
        processor = self.processor
        if processor is None:  # an engine on token ids only
            return f"<{token_id}>"
        if hasattr(processor, "id_to_piece"):  # sentencepiece: keep the word-initial space
            return processor.id_to_piece(token_id).replace("\u2581", " ")
        return processor.decode([token_id], skip_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.processor is None:
            return "".join(map(self.text, ids))
        if hasattr(self.processor, "id_to_piece"):
            return self.processor.decode(list(ids))
        return self.processor.decode(list(ids), skip_special_tokens=True)

    def entries(self, ids: list[int], logprobs: list[float], tops: list) -> list:
        tops = tops or [[] for _ in ids]
        return [[self.text(t), lp, [[self.text(a), alp] for a, alp in top]] for t, lp, top in zip(ids, logprobs, tops)]

    def echo(self, prompt, request, logprobs: bool) -> dict:
        """The prompt as it was sent (token ids decoded) and, with logprobs, an entry for every prompt
        token, as OpenAI and vLLM echo: the first has logprob None (nothing comes before it)."""
        echo = {"text": prompt if isinstance(prompt, str) else self.decode(request.prompt_ids)}
        if logprobs:
            ids, lps, tops = request.prompt_ids, request.prompt_logprobs, request.prompt_top_logprobs
            echo["logprobs"] = [[self.text(ids[0]), None, None], *self.entries(ids[1:], lps[1:], tops[1:])]
        return echo
