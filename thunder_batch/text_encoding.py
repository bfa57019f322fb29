"""Raw text -> token ids as Hugging Face's tokenizer for the checkpoint does (pure Python, no torch).

litgpt's Tokenizer decides the BOS by the checkpoint's name as well as its config (it forces one for
SmolLM2-Instruct and Llama-3 directories) and strips a trailing EOS the text spelled out, so a prompt
scored through it is not the text the model's own tokenizer sees. Here the rule is Hugging Face's:
`tokenizer.json` encodes with its own post-processor (special tokens written in the text stay whole,
an EOS at the end included), and a BOS is put in front only when tokenizer_config.json says
`add_bos_token: true` and the post-processor did not put one there (the slow tokenizers and the
Llama/Gemma fast ones do that). A sentencepiece `tokenizer.model` follows `add_bos_token` too (true by
default for LlamaTokenizer, as in transformers).
"""

from __future__ import annotations

import json
from pathlib import Path


class TextEncoder:
    """encode(text) -> token ids. processor: a `tokenizers.Tokenizer` or a sentencepiece processor."""

    def __init__(self, processor, bos_id: int | None = None, add_bos: bool = False) -> None:
        self.processor, self.bos_id = processor, bos_id
        self._sentencepiece = hasattr(processor, "id_to_piece")  # no post-processor of its own
        self.prepend_bos = add_bos and bos_id is not None and not self._post_processor_adds_bos()

    @classmethod
    def for_checkpoint(cls, checkpoint_dir: Path | str, tokenizer) -> TextEncoder:
        """The encoder of the checkpoint dir whose litgpt Tokenizer is `tokenizer` (its processor, BOS id)."""
        processor = getattr(tokenizer, "processor", tokenizer)
        return cls(processor, getattr(tokenizer, "bos_id", None), add_bos_token(checkpoint_dir, processor))

    def encode(self, text: str) -> list[int]:
        if self._sentencepiece:
            ids = list(self.processor.encode(text))
        else:
            ids = self.processor.encode(text, add_special_tokens=True).ids
        return [self.bos_id, *ids] if self.prepend_bos else ids

    def _post_processor_adds_bos(self) -> bool:
        if self._sentencepiece:
            return False
        return self.processor.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]


def add_bos_token(checkpoint_dir: Path | str, processor=None) -> bool:
    """tokenizer_config.json's `add_bos_token`; absent: true for a sentencepiece LlamaTokenizer, else false."""
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if "add_bos_token" in config:
        return bool(config["add_bos_token"])
    return hasattr(processor, "id_to_piece") and config.get("tokenizer_class") == "LlamaTokenizer"


def text_encoder(tokenizer) -> TextEncoder:
    """The encoder `checkpoints.load_checkpoint` gave this tokenizer; for any other, its `tokenizer.json`
    alone (what transformers does with a tokenizer.json) or, for sentencepiece, litgpt's `use_bos`."""
    encoder = getattr(tokenizer, "text_encoder", None)
    if encoder is None:
        processor = getattr(tokenizer, "processor", tokenizer)
        add_bos = hasattr(processor, "id_to_piece") and bool(getattr(tokenizer, "use_bos", False))
        encoder = TextEncoder(processor, getattr(tokenizer, "bos_id", None), add_bos)
    return encoder
