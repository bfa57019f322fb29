"""A litgpt llama GPT written as a GGUF file llama.cpp reads: the same weights for the engine and llama.cpp. A
config with a bias on q, k and v (Qwen2's) is written as llama.cpp's qwen2 architecture (biases, rows unpermuted).

The block linears and the head go in one of the formats the `gguf` package makes (quantized.QUANTIZABLE) or f32,
already-quantized linears as their own blocks; norms and the embedding in f32. Q/K rows are put in llama.cpp's
RoPE order (the inverse of gguf_convert.unpermute_rope_rows). The tokenizer metadata is copied from a GGUF of the
same vocabulary (the bundled SmolLM2 file by default: SmolLM2 configs of any size share it). What the bench writes
for `--random_weights` (benchmarks/quantized_vs_llama_cpp.py).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from thunder_batch import gguf_convert, quantized

# tokenizer.ggml.* keys copied as they are (GGUFWriter's method for each).
_TOKENIZER_FIELDS = {
    "tokenizer.ggml.model": "add_tokenizer_model",
    "tokenizer.ggml.pre": "add_tokenizer_pre",
    "tokenizer.ggml.tokens": "add_token_list",
    "tokenizer.ggml.token_type": "add_token_types",
    "tokenizer.ggml.merges": "add_token_merges",
    "tokenizer.ggml.bos_token_id": "add_bos_token_id",
    "tokenizer.ggml.eos_token_id": "add_eos_token_id",
    "tokenizer.ggml.unknown_token_id": "add_unk_token_id",
    "tokenizer.ggml.padding_token_id": "add_pad_token_id",
    "tokenizer.ggml.add_bos_token": "add_add_bos_token",
    "tokenizer.chat_template": "add_chat_template",
}
# llama.cpp's general.file_type (LLAMA_FTYPE_*) per format written.
FILE_TYPES = {"f32": 0, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9}


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """litgpt's RoPE row order -> llama.cpp's (convert_hf_to_gguf's `permute`): [n_head * D, ...]."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(gpt, path: Path | str, file_format: str, tokenizer_from: Path | str | None = None) -> Path:
    """Writes `gpt` (a litgpt llama GPT, float32 weights) to `path` with its linears in `file_format`."""
    from thunder_batch.checkpoints import bundled_gguf_path

    if file_format not in FILE_TYPES:
        raise ValueError(f"file_format must be one of {', '.join(FILE_TYPES)}; got {file_format!r}")
    source = gguf.GGUFReader(tokenizer_from or bundled_gguf_path())
    config = gpt.config
    vocab = len(gguf_convert.read_field(source, "tokenizer.ggml.tokens"))
    if vocab != config.padded_vocab_size:
        raise ValueError(f"{config.name} has {config.padded_vocab_size} tokens; the tokenizer's GGUF has {vocab}")
    arch = "qwen2" if config.attn_bias else gguf_convert.SUPPORTED_ARCH
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, config, FILE_TYPES[file_format])
    _copy_tokenizer(writer, source)
    for name, data, kind in _tensors(gpt, file_format, permute=arch == "llama"):
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def _write_metadata(writer, config, file_type: int) -> None:
    writer.add_name(config.name)
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_query_groups)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.rope_n_elem)
    writer.add_vocab_size(config.padded_vocab_size)
    writer.add_file_type(file_type)


def _copy_tokenizer(writer, source) -> None:
    for key, method in _TOKENIZER_FIELDS.items():
        value = gguf_convert.read_field(source, key)
        if value is not None:
            getattr(writer, method)(value)


def _tensors(gpt, file_format: str, permute: bool = True):
    """(GGUF name, data, ggml type or None for float32) for every tensor, in llama.cpp's names; q and k rows in
    llama.cpp's RoPE order where `permute` (llama files)."""
    yield "token_embd.weight", _f32(gpt.transformer.wte.weight), None
    yield "output_norm.weight", _f32(gpt.transformer.ln_f.weight), None
    yield ("output.weight", *_linear(gpt.lm_head, file_format))
    names = {value: key for key, value in gguf_convert._BLOCK_MAP.items()}
    config = gpt.config
    for i, block in enumerate(gpt.transformer.h):
        for path, name in names.items():
            module = block.get_submodule(path)
            if "norm" in path:
                yield f"blk.{i}.{name}.weight", _f32(module.weight), None
            else:
                yield (f"blk.{i}.{name}.weight", *_linear(module, file_format))
        qkv = block.attn.qkv
        q, k, v = _qkv_rows(qkv, config)
        owners = list(qkv.parts) if isinstance(qkv, quantized.QuantizedParts) else [qkv] * 3
        for name, rows, heads, owner in zip(
            ("attn_q", "attn_k"), (q, k), (config.n_head, config.n_query_groups), owners
        ):
            rows = permute_rope_rows(rows, heads) if permute else rows
            yield (f"blk.{i}.{name}.weight", *_rows(rows, owner, file_format))
        yield (f"blk.{i}.attn_v.weight", *_rows(v, owners[2], file_format))
        for name, bias in zip(("attn_q", "attn_k", "attn_v"), _qkv_biases(qkv, config)):
            yield f"blk.{i}.{name}.bias", _f32(bias), None


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().numpy()


def _qkv_rows(qkv, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """litgpt's fused qkv rows (cat(q, k, v)), as float32 weights or as blocks (a QuantizedParts': its parts')."""
    if isinstance(qkv, quantized.QuantizedParts):
        return tuple(part.weight.detach() for part in qkv.parts)
    q_rows, kv_rows = config.n_head * config.head_size, config.n_query_groups * config.head_size
    return torch.split(qkv.weight.detach(), [q_rows, kv_rows, kv_rows])


def _qkv_biases(qkv, config) -> tuple:
    """The q, k and v biases of litgpt's fused qkv (a QuantizedParts': its parts'), or none."""
    if isinstance(qkv, quantized.QuantizedParts):
        return tuple(part.bias for part in qkv.parts) if qkv.parts[0].bias is not None else ()
    if qkv.bias is None:
        return ()
    q_rows, kv_rows = config.n_head * config.head_size, config.n_query_groups * config.head_size
    return torch.split(qkv.bias.detach(), [q_rows, kv_rows, kv_rows])


def _linear(module, file_format: str):
    return _rows(module.weight.detach(), module, file_format)


def _rows(rows: torch.Tensor, module, file_format: str):
    """(data, ggml type): a QuantizedLinear's blocks as they are, float32 rows quantized to `file_format`."""
    if isinstance(module, quantized.QuantizedLinear):
        return rows.cpu().numpy(), gguf.GGMLQuantizationType(module.ggml_type)
    if file_format == "f32":
        return _f32(rows), None
    kind = quantized.format_id(file_format, to_make=True)
    return quantized.quantize_weight(rows, kind).numpy(), gguf.GGMLQuantizationType(kind)
