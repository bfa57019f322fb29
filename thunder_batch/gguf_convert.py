"""Convert a llama-architecture GGUF file (llama.cpp) into a litgpt checkpoint dir; what the loader shares
(architectures, hyperparameters, the tokenizer rebuilt from the metadata).

Weights are dequantized to fp32 (lossless with respect to the GGUF), Q/K rows are put back
in the Hugging Face order litgpt's RoPE expects, and the tokenizer is rebuilt from the
GGUF metadata with the `tokenizers` library. Imported lazily by `checkpoints`, so loading
a checkpoint never needs `gguf`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

import gguf
import litgpt
import numpy as np
import torch
from litgpt.utils import save_config
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

SUPPORTED_ARCH = "llama"  # what the converter writes a checkpoint dir from
# What gguf_load reads: llama's, and Qwen2's (a bias on q, k and v; rows in the Hugging Face order, unpermuted).
LOADABLE_ARCHS = ("llama", "qwen2")
# Qwen2's pre-tokenizer split, as its tokenizer.json has it (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3's split (its tokenizer.json's: three digits at a time), for llama.cpp's pre names of it; its BPE takes a
# word found whole in the vocabulary as it is (ignore_merges, as llama.cpp and tiktoken).
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_OWN_SPLITS = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token_type codes
# Global tensors: llama.cpp name -> litgpt state-dict key.
_GLOBAL_MAP = {
    "token_embd.weight": "transformer.wte.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output.weight": "lm_head.weight",
}
# Per-block tensors (blk.N.<kind>.weight); attn_q/k/v are fused into attn.qkv separately.
_BLOCK_MAP = {
    "attn_norm": "norm_1",
    "attn_output": "attn.proj",
    "ffn_norm": "norm_2",
    "ffn_gate": "mlp.fc_1",
    "ffn_up": "mlp.fc_2",
    "ffn_down": "mlp.proj",
}
# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) that are GPT-2 byte-level BPE, with or
# without splitting every digit first (llama.cpp adds a "\p{N}" regex for the latter).
_PRE_DIGITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PRE_PLAIN = {"default", "gpt-2", "gpt2"}


def convert_gguf_to_litgpt(gguf_path: Path | str, out_dir: Path | str, model_name: str) -> Path:
    """Convert a llama-architecture GGUF into the litgpt checkpoint dir `out_dir` (fp32 weights), atomically.

    `model_name` picks the litgpt config; it must match the GGUF metadata (ValueError otherwise). Name
    `out_dir` after the model: litgpt keys tokenizer BOS handling on the dir name.
    Raises FileExistsError if `out_dir` exists and is not empty.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(errno.EEXIST, "refusing to overwrite an existing checkpoint dir", str(out_dir))
    if out_dir.name != model_name:
        # litgpt keys BOS handling on the dir name (and the engine finds stop tokens through it).
        warnings.warn(f"checkpoint dir {out_dir.name!r} is not named after the model {model_name!r}", stacklevel=3)
    reader = gguf.GGUFReader(gguf_path)
    if check_architecture(reader, gguf_path) != SUPPORTED_ARCH:
        raise ValueError(f"{str(gguf_path)!r}: only llama files convert to a checkpoint dir; load it as a .gguf")
    config = litgpt.Config.from_name(model_name)
    check_config_matches(reader, config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build next to out_dir (same filesystem) and rename: readers never see a half dir.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_checkpoint(reader, config, tmp)
        _publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_field(reader: gguf.GGUFReader, key: str, default=None):
    """A metadata value as Python (str, int, float, bool or list), or `default` if absent."""
    field = reader.get_field(key)
    if field is None:
        return default
    values = [field.parts[i] for i in field.data]
    is_str = field.types[-1] == gguf.GGUFValueType.STRING
    items = [bytes(v).decode("utf-8") if is_str else v.tolist()[0] for v in values]
    return items if field.types[0] == gguf.GGUFValueType.ARRAY else items[0]


def check_architecture(reader: gguf.GGUFReader, path: Path | str = "") -> str:
    """The file's architecture, one of LOADABLE_ARCHS; ValueError naming them otherwise."""
    arch = read_field(reader, "general.architecture")
    if arch not in LOADABLE_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {str(path)!r}: only {', '.join(LOADABLE_ARCHS)} can be read"
        )
    return arch


def check_config_matches(reader: gguf.GGUFReader, config: litgpt.Config) -> None:
    """Raise ValueError listing every hyperparameter where the litgpt config and the GGUF disagree."""
    pairs = _hyperparameters(reader, config)
    arch = read_field(reader, "general.architecture")
    bad = [f"{field}={cv!r} but GGUF {arch}.{key}={gv!r}" for key, gv, field, cv in pairs if not _same(gv, cv)]
    if bad:
        raise ValueError(f"litgpt config {config.name!r} does not match the GGUF: " + "; ".join(bad))


def _hyperparameters(reader: gguf.GGUFReader, config: litgpt.Config) -> list[tuple]:
    """(GGUF key, GGUF value, config field, config value) for every hyperparameter both carry."""

    arch = read_field(reader, "general.architecture")

    def stored(key: str, default=None):
        return read_field(reader, f"{arch}.{key}", default)

    n_head = stored("attention.head_count")
    n_vocab = stored("vocab_size") or len(read_field(reader, "tokenizer.ggml.tokens", []))
    rope_adjustments = "none" if config.rope_adjustments is None else config.rope_adjustments
    return [
        ("block_count", stored("block_count"), "n_layer", config.n_layer),
        ("embedding_length", stored("embedding_length"), "n_embd", config.n_embd),
        ("feed_forward_length", stored("feed_forward_length"), "intermediate_size", config.intermediate_size),
        ("attention.head_count", n_head, "n_head", config.n_head),
        # llama.cpp defaults the KV head count to the head count when the key is absent.
        ("attention.head_count_kv", stored("attention.head_count_kv", n_head), "n_query_groups", config.n_query_groups),
        ("rope.freq_base", stored("rope.freq_base", 10000.0), "rope_base", config.rope_base),
        ("attention.layer_norm_rms_epsilon", stored("attention.layer_norm_rms_epsilon"), "norm_eps", config.norm_eps),
        ("rope.dimension_count", stored("rope.dimension_count", config.head_size), "rope_n_elem", config.rope_n_elem),
        ("context_length", stored("context_length"), "block_size", config.block_size),
        # llama.cpp's converter pads the token list to the model's embedding rows (Qwen2's 151936 for 151643 tokens)
        ("vocab_size", n_vocab, "vocab_size", n_vocab if n_vocab == config.padded_vocab_size else config.vocab_size),
        ("rope.scaling.type", stored("rope.scaling.type", "none"), "rope_adjustments", rope_adjustments),
        ("(q, k, v bias)", arch == "qwen2", "attn_bias", config.attn_bias or config.bias),
    ]


def _same(a, b) -> bool:
    # GGUF stores floats as fp32 (1e-5 reads back as 9.9999997e-06).
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-6)
    return a == b


def _write_checkpoint(reader: gguf.GGUFReader, config: litgpt.Config, out: Path) -> None:
    state = litgpt_state_dict(reader, config)
    check_state_dict(state, config)
    torch.save(state, out / "lit_model.pth")
    save_config(config, out)
    build_tokenizer(reader).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(reader, config))
    _write_json(out / "generation_config.json", generation_config(reader))
    _fsync_tree(out)


def litgpt_state_dict(reader: gguf.GGUFReader, config: litgpt.Config) -> dict[str, torch.Tensor]:
    """Dequantize every tensor and map it to litgpt's llama state-dict keys."""
    state: dict[str, torch.Tensor] = {}
    qkv: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    for t in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor"):
        weight = _dequantize(t)
        block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if t.name in _GLOBAL_MAP:
            state[_GLOBAL_MAP[t.name]] = weight
        elif block and block[2] in ("attn_q", "attn_k", "attn_v"):
            qkv[int(block[1])][block[2]] = weight
        elif block and block[2] in _BLOCK_MAP:
            state[f"transformer.h.{block[1]}.{_BLOCK_MAP[block[2]]}.weight"] = weight
        else:
            raise ValueError(f"GGUF tensor {t.name!r} has no litgpt counterpart in this converter")
    for i, w in qkv.items():
        if len(w) != 3:
            raise ValueError(f"block {i} lacks one of attn_q/attn_k/attn_v: found {sorted(w)}")
        q = unpermute_rope_rows(w["attn_q"], config.n_head)  # [H*D, C]
        k = unpermute_rope_rows(w["attn_k"], config.n_query_groups)  # [G*D, C]
        # litgpt 0.5.13 fuses HF weights as cat(q, k, v) (scripts/convert_hf_checkpoint.py).
        state[f"transformer.h.{i}.attn.qkv.weight"] = torch.cat((q, k, w["attn_v"]))  # [(H+2G)*D, C]
    # Tied embeddings: llama.cpp omits output.weight and reuses token_embd.
    state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    return state


def _dequantize(t) -> torch.Tensor:
    # GGUF lists dims innermost first (ne0 = input features); torch wants [out, in].
    shape = tuple(int(n) for n in reversed(t.shape))
    array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    return torch.tensor(np.asarray(array, dtype=np.float32))  # copies out of the memory map


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's `permute`.

    llama.cpp's "normal" RoPE rotates adjacent pairs (rows 2i, 2i+1 of a head); HF and
    litgpt rotate the two halves (rows i, i + D/2), so the converter interleaved each head.
    """
    rows = w.shape[0]
    # w: [n_head * D, C] -> [n_head, D/2, 2, C] -> [n_head, 2, D/2, C] -> [n_head * D, C]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_state_dict(state: dict[str, torch.Tensor], config: litgpt.Config) -> None:
    """Keys and shapes must equal those of `litgpt.GPT(config)`, built on the meta device (free)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in litgpt.GPT(config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
        shapes = [
            f"{k}: {got[k]} != {expected[k]}" for k in sorted(expected.keys() & got.keys()) if got[k] != expected[k]
        ]
        raise ValueError(
            f"converted weights do not fit {config.name!r}: missing {missing}, unexpected {extra}, shapes {shapes}"
        )


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """A Hugging Face `tokenizers` byte-level BPE rebuilt from tokenizer.ggml.* metadata."""
    kind, pre = read_field(reader, "tokenizer.ggml.model"), read_field(reader, "tokenizer.ggml.pre", "default")
    known = _PRE_DIGITS | _PRE_PLAIN | set(_OWN_SPLITS)
    if kind != "gpt2" or pre not in known:
        raise ValueError(
            f"unsupported GGUF tokenizer model={kind!r} pre={pre!r}: only byte-level BPE "
            f"(model 'gpt2', pre one of {sorted(known)}) can be rebuilt"
        )
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens; ids would be lost")
    merges = [tuple(m.split(" ")) for m in read_field(reader, "tokenizer.ggml.merges")]
    whole = pre in _OWN_SPLITS and pre != "qwen2"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=whole))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in _OWN_SPLITS)
    splits = [pre_tokenizers.Digits(individual_digits=True)] if pre in _PRE_DIGITS else []
    if pre in _OWN_SPLITS:  # its own split, then bytes to characters (as its tokenizer.json)
        splits = [pre_tokenizers.Split(Regex(_OWN_SPLITS[pre]), behavior="isolated")]
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = read_field(reader, "tokenizer.ggml.token_type", [])
    tok.add_special_tokens(_added_tokens(tokens, types, _TOKEN_CONTROL))  # ids kept; skipped when decoding
    tok.add_tokens(_added_tokens(tokens, types, _TOKEN_USER_DEFINED))
    return tok


def _added_tokens(tokens: list[str], types: list[int], code: int) -> list[AddedToken]:
    # Added tokens are matched whole before BPE, so "<|im_start|>" never splits into pieces.
    special = code == _TOKEN_CONTROL
    return [AddedToken(tokens[i], special=special, normalized=False) for i, ty in enumerate(types) if ty == code]


def tokenizer_config(reader: gguf.GGUFReader, config: litgpt.Config) -> dict:
    """HF-style tokenizer_config.json; litgpt reads tokenizer_class, bos_token and eos_token."""
    tokens = read_field(reader, "tokenizer.ggml.tokens")
    types = read_field(reader, "tokenizer.ggml.token_type", [])
    cfg: dict = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.block_size,
    }
    for name in ("bos", "eos", "unknown", "padding"):
        if (i := read_field(reader, f"tokenizer.ggml.{name}_token_id")) is not None:
            cfg[{"unknown": "unk_token", "padding": "pad_token"}.get(name, f"{name}_token")] = tokens[i]
    if (add_bos := read_field(reader, "tokenizer.ggml.add_bos_token")) is not None:
        cfg["add_bos_token"] = bool(add_bos)
    if (template := read_field(reader, "tokenizer.chat_template")) is not None:
        cfg["chat_template"] = template
    cfg["added_tokens_decoder"] = {
        str(i): {
            "content": tokens[i],
            "special": ty == _TOKEN_CONTROL,
            "normalized": False,
            "lstrip": False,
            "rstrip": False,
            "single_word": False,
        }
        for i, ty in enumerate(types)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    return cfg


def generation_config(reader: gguf.GGUFReader) -> dict:
    """litgpt falls back to these ids when tokenizer_config.json names no bos/eos token."""
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    ids = {k: read_field(reader, f"tokenizer.ggml.{v}_token_id") for k, v in keys.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_tree(directory: Path) -> None:
    # Flush file contents before the rename publishes them (a crash must not expose empty files).
    for path in directory.iterdir():
        with open(path, "rb") as fp:
            os.fsync(fp.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, out_dir: Path) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    try:
        os.rename(tmp, out_dir)  # atomic; replaces nothing but an empty dir
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise FileExistsError(errno.EEXIST, "checkpoint dir appeared during conversion", str(out_dir)) from e
        raise
    _fsync_dir(out_dir.parent)
