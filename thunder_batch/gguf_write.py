"""A litgpt llama GPT written as a GGUF file llama.cpp reads: the same weights for the engine and llama.cpp. A
config with a bias on q, k and v (Qwen2's) is written as llama.cpp's qwen2 architecture (biases, rows unpermuted).

The block linears and the head go in one of the formats the `gguf` package makes (quantized.QUANTIZABLE) or in
f32, f16 or bf16, already-quantized linears as their own blocks; norms in f32, the embedding in f32 (or the float
format asked). Q/K rows are put in llama.cpp's RoPE order (the inverse of gguf_convert.unpermute_rope_rows), and
a llama3 RoPE scaling goes in as llama.cpp's `rope_freqs` factors. The tokenizer metadata is copied from a GGUF
(the bundled SmolLM2 file by default, the tokenizer `--random_weights` models use), its token list padded to the
model's vocabulary. What the bench gives llama.cpp (bench.llama_cpp_files, benchmarks/quantized_vs_llama_cpp.py).
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import gguf
import litgpt
import numpy as np
import torch

from thunder_batch import gguf_convert, gguf_load, quantized

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
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9}
FLOATS = ("f32", "f16", "bf16")
_USER_DEFINED = 4  # a token type whose text llama.cpp prints as it is: the padding tokens'


def unwritable(config) -> str | None:
    """Why `config` cannot be written as a llama or qwen2 GGUF, or None."""
    from thunder_batch.checkpoints import LLAMA_LAYOUT

    # The llama layout; a qkv bias makes it qwen2, a llama3 RoPE scaling goes in as rope_freqs (checked below).
    layout = {k: v for k, v in LLAMA_LAYOUT.items() if k not in ("attn_bias", "rope_adjustments")}
    wrong = [f"{k}={getattr(config, k, None)!r}" for k, v in layout.items() if getattr(config, k, v) != v]
    llama3 = {"factor", *gguf_load.LLAMA3_ROPE_DEFAULTS}
    if config.rope_adjustments is not None and set(config.rope_adjustments) != llama3:
        wrong.append(f"rope_adjustments={config.rope_adjustments!r}")
    return f"{config.name} is not in a llama or qwen2 layout ({', '.join(wrong)})" if wrong else None


def permute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """litgpt's RoPE row order -> llama.cpp's (convert_hf_to_gguf's `permute`): [n_head * D, ...]."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(gpt, path: Path | str, file_format: str, tokenizer_from: Path | str | None = None) -> Path:
    """Writes `gpt` (a litgpt GPT in a llama or qwen2 layout) to `path` with its float linears in `file_format`;
    ValueError if its layout or vocabulary cannot be written."""
    if file_format not in FILE_TYPES:
        raise ValueError(f"file_format must be one of {', '.join(FILE_TYPES)}; got {file_format!r}")
    if why := unwritable(gpt.config):
        raise ValueError(why)
    writer, arch = _writer(gpt.config, path, FILE_TYPES[file_format], tokenizer_from)
    for name, data, kind in _tensors(gpt, file_format, permute=arch == "llama"):
        writer.add_tensor(name, data, raw_dtype=kind)
    _finish(writer)
    return Path(path)


def _writer(config, path, file_type: int, tokenizer_from) -> tuple[gguf.GGUFWriter, str]:
    """A writer holding the file's metadata and tokenizer, and the architecture it writes."""
    from thunder_batch.checkpoints import bundled_gguf_path

    source = Path(tokenizer_from or bundled_gguf_path())
    stat = source.stat()
    fields = _tokenizer_fields(str(source.resolve()), stat.st_size, stat.st_mtime_ns)
    vocab = len(fields["tokenizer.ggml.tokens"])
    if vocab > config.padded_vocab_size:
        raise ValueError(f"{config.name} has {config.padded_vocab_size} tokens; the tokenizer's GGUF has {vocab}")
    arch = "qwen2" if config.attn_bias else gguf_convert.SUPPORTED_ARCH
    writer = gguf.GGUFWriter(path, arch)
    _write_metadata(writer, config, file_type)
    _copy_tokenizer(writer, fields, config.padded_vocab_size)
    if config.rope_adjustments is not None:
        writer.add_tensor("rope_freqs.weight", gguf_load.llama3_rope_factors(config))
    return writer, arch


def _finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, config, file_type: int) -> None:
    writer.add_name(config.name)
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_query_groups)
    writer.add_key_length(config.head_size)
    writer.add_value_length(config.head_size)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_rope_dimension_count(config.rope_n_elem)
    writer.add_vocab_size(config.padded_vocab_size)
    writer.add_file_type(file_type)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(path: str, size: int, mtime_ns: int) -> dict:
    """A GGUF's tokenizer keys, read once per file version (keyed on its size and time: the gguf reader takes
    seconds over a 49k-token list)."""
    source = gguf.GGUFReader(path)
    return {key: gguf_convert.read_field(source, key) for key in _TOKENIZER_FIELDS}


def _copy_tokenizer(writer, fields: dict, vocab_size: int) -> None:
    """The tokenizer keys; the token list padded to `vocab_size` with user-defined "[PAD i]" tokens (a config's
    vocabulary may be larger than the tokenizer's: the embedding's rows are what llama.cpp checks)."""
    for key, method in _TOKENIZER_FIELDS.items():
        value = fields[key]
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type") and value is not None:
            start = len(value)
            value = list(value) + [
                f"[PAD{i}]" if key.endswith("tokens") else _USER_DEFINED for i in range(start, vocab_size)
            ]
        if value is not None:
            getattr(writer, method)(value)


def _tensors(gpt, file_format: str, permute: bool = True):
    """(GGUF name, data, ggml type or None for float32) for every tensor, in llama.cpp's names; q and k rows in
    llama.cpp's RoPE order where `permute` (llama files)."""
    yield ("token_embd.weight", *_float(gpt.transformer.wte.weight, file_format if file_format in FLOATS else "f32"))
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


def _float(t: torch.Tensor, file_format: str):
    """(data, ggml type or None: the array's own) of a float tensor in f32, f16 or bf16 (rounded to nearest)."""
    t = t.detach().cpu()
    if file_format == "bf16":  # numpy has no bfloat16: its bytes, which the writer reads as [rows, 2 x columns]
        return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16
    return (t.to(torch.float16).numpy() if file_format == "f16" else _f32(t)), None


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
    if file_format in FLOATS:
        return _float(rows, file_format)
    kind = quantized.format_id(file_format, to_make=True)
    return quantized.quantize_weight(rows, kind).numpy(), gguf.GGMLQuantizationType(kind)


# llama.cpp's K-quant mixes (llama-quant.cpp): name -> (most tensors' format, the format of attn_v and ffn_down in
# its "more bits" layers), the head in Q6_K; and each mix's general.file_type.
K_MIXES = {"q4_k_m": ("q4_k", "q6_k"), "q5_k_m": ("q5_k", "q6_k"), "q6_k": ("q6_k", "q6_k")}
K_FILE_TYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
# llama.cpp's format for a row width the K-quants' 256-weight blocks do not divide (tensor_type_fallback).
_K_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _fitting(fmt: str, width: int) -> str:
    """`fmt`, or llama.cpp's fallback where its blocks do not divide `width` (f16 where none does)."""
    if width % quantized.block_size(quantized.FORMATS[fmt])[0] == 0:
        return fmt
    fallback = _K_FALLBACK.get(fmt, "f16")
    return fallback if width % quantized.block_size(quantized.FORMATS[fallback])[0] == 0 else "f16"


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down an _M mix keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def write_random_gguf(config, path: Path | str, mix: str, seed: int = 0, tokenizer_from=None) -> Path:
    """A GGUF of `config` in llama.cpp's K-quant mix `mix` whose linears and embedding are random blocks
    (quantized.random_blocks), norms ones and biases zeros: what `--random_weights NAME --quantization q4_k_m` loads
    and llama.cpp runs (the `gguf` package cannot make K-quants from weights; a step's cost does not depend on the
    values). A width the K-quant blocks (256) do not divide takes llama.cpp's fallback format, as its quantizer does."""
    if mix not in K_MIXES:
        raise ValueError(f"mix must be one of {', '.join(K_MIXES)}; got {mix!r}")
    if why := unwritable(config):
        raise ValueError(why)
    C, L, hidden = config.n_embd, config.n_layer, config.intermediate_size
    q_rows, kv_rows = config.n_head * config.head_size, config.n_query_groups * config.head_size
    writer, _ = _writer(config, path, K_FILE_TYPES[mix], tokenizer_from)
    seeds = iter(range(seed, seed + 10 * L + 10))

    def blocks(name: str, fmt: str, rows: int, width: int) -> None:
        fmt = _fitting(fmt, width)
        data = quantized.random_blocks(fmt, rows, width, next(seeds))
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(quantized.FORMATS[fmt]))

    default, more = K_MIXES[mix]
    blocks("token_embd.weight", default, config.padded_vocab_size, C)
    writer.add_tensor("output_norm.weight", np.ones(C, np.float32))
    blocks("output.weight", "q6_k", config.padded_vocab_size, C)
    for i in range(L):
        v = more if _more_bits(i, L) else default
        shapes = dict(attn_q=(default, q_rows, C), attn_k=(default, kv_rows, C), attn_v=(v, kv_rows, C))
        shapes.update(attn_output=(default, C, q_rows), ffn_gate=(default, hidden, C), ffn_up=(default, hidden, C))
        for name, (fmt, rows, width) in {**shapes, "ffn_down": (v, C, hidden)}.items():
            blocks(f"blk.{i}.{name}.weight", fmt, rows, width)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(C, np.float32))
        for name, rows in dict(attn_q=q_rows, attn_k=kv_rows, attn_v=kv_rows).items() if config.attn_bias else ():
            writer.add_tensor(f"blk.{i}.{name}.bias", np.zeros(rows, np.float32))
    _finish(writer)
    return Path(path)


def random_k_quant_model(name: str, mix: str, folder: Path | None = None, seed: int = 0):
    """random_weights_model's tuple for litgpt's config `name` in llama.cpp's K-quant mix `mix` (e.g. q4_k_m):
    random blocks written as a GGUF file (gguf_write.write_random_gguf), loaded as a real file is, kept quantized.
    The file stays in `folder` when one is given (the bench runs llama.cpp on it), else it is removed."""
    from thunder_batch.checkpoints import default_tokenizer

    config = litgpt.Config.from_name(name)
    tokenizer, checkpoint_dir = default_tokenizer()
    with tempfile.TemporaryDirectory(prefix="thunder-batch-") as scratch:  # the loaded blocks keep the file's pages
        path = Path(folder or scratch) / f"{name.replace('/', '_')}.{mix}.gguf"
        write_random_gguf(config, path, mix, seed)
        model, _, _ = gguf_load.load_gguf(path, model_name=name)
    return model, tokenizer, config, checkpoint_dir
