"""The GGUF file llama.cpp runs beside each of the bench's models: the engine's own weights, in their own formats.

A file given with --llama_cpp_gguf (the GGUF checkpoint itself is given by `thunder-batch bench`) serves the model
whose linears are in that file's formats. For any other model the bench writes one (gguf_write: quantized blocks as
they are, float weights in the model's precision) into a folder that lasts the run. So a bf16 model, or
`--random_weights NAME --quantization q4_0`, runs beside llama.cpp on the same weights with no file made by hand.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

# llama.cpp's general.file_type (LLAMA_FTYPE_*) -> name: a file's label in the report.
FILE_TYPE_NAMES = {
    0: "f32",
    1: "f16",
    32: "bf16",
    2: "q4_0",
    3: "q4_1",
    7: "q8_0",
    8: "q5_0",
    9: "q5_1",
    14: "q4_k_s",
    15: "q4_k_m",
    16: "q5_k_s",
    17: "q5_k_m",
    18: "q6_k",
}
FLOAT_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# A GGUF's linears: the blocks' matrices and the head.
_LINEAR = re.compile(r"blk\.\d+\.(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)\.weight|output\.weight")


def file_formats(path: str | Path) -> frozenset[str]:
    """The formats of a GGUF's linears, e.g. {"q4_k", "q6_k"}; a file without output.weight ties its head to the
    embedding, whose format is then the head's."""
    return _described(path)[1]


def file_label(path: str | Path) -> str:
    """A GGUF's file type by llama.cpp's name (e.g. q4_k_m), else its number."""
    return _described(path)[0]


def _described(path: str | Path) -> tuple[str, frozenset[str]]:
    stat = Path(path).stat()
    return _read_description(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_description(path: str, size: int, mtime_ns: int) -> tuple[str, frozenset[str]]:
    """(label, linear formats) of a file, read once per version of it (the gguf reader takes seconds over a
    tokenizer's lists)."""
    import gguf

    from thunder_batch import quantized
    from thunder_batch.gguf_convert import read_field

    reader = gguf.GGUFReader(path)
    kinds = {t.name: int(t.tensor_type) for t in reader.tensors}
    if "output.weight" not in kinds and "token_embd.weight" in kinds:
        kinds["output.weight"] = kinds["token_embd.weight"]
    names = {**quantized.FORMAT_NAMES, 0: "f32"}
    formats = frozenset(names.get(kind, f"type {kind}") for name, kind in kinds.items() if _LINEAR.fullmatch(name))
    kind = read_field(reader, "general.file_type")
    return FILE_TYPE_NAMES.get(kind, f"file type {kind}"), formats


def model_formats(gpt) -> frozenset[str]:
    """The formats of a litgpt GPT's block linears and head: quantized formats by name, float ones by precision."""
    from torch import nn

    from thunder_batch import quantized

    formats = set()
    for module in gpt.modules():
        if isinstance(module, quantized.QuantizedLinear):
            formats.add(quantized.FORMAT_NAMES[module.ggml_type])
        elif type(module) is nn.Linear:
            formats.add(FLOAT_NAMES[str(module.weight.dtype).removeprefix("torch.")])
    return frozenset(formats)


class LlamaCppFiles:
    """The GGUF for each model llama.cpp runs beside: a given one in the model's formats, else one written."""

    def __init__(self, given: str | None, folder: Path, tokenizer_from: str | None = None) -> None:
        paths = [p.strip() for p in (given or "").split(",") if p.strip()]
        self.given = {path: file_formats(path) for path in paths}
        self.folder, self.tokenizer_from = folder, tokenizer_from  # the GGUF whose tokenizer written files copy

    def for_model(self, gpt) -> str:
        """The file for `gpt`; ValueError naming why none can be written (a layout gguf_write does not write)."""
        from thunder_batch import gguf_write

        formats = model_formats(gpt)
        for path, its_formats in self.given.items():
            if its_formats == formats:
                return path
        # The float format of the model's float linears, if it has any; else only the file's label.
        labels = sorted(f for f in formats if f in gguf_write.FLOATS) or sorted(formats & set(gguf_write.FILE_TYPES))
        label = labels[0] if labels else "f32"
        # One bench's models are its checkpoint in several precisions: a name and formats tell them apart.
        path = self.folder / f"{gpt.config.name.replace('/', '_')}.{'-'.join(sorted(formats))}.gguf"
        if not path.exists():
            gguf_write.write_gguf(gpt, path, label, self.tokenizer_from)
        return str(path)
