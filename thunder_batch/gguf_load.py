"""Load a llama- or qwen2-architecture GGUF file (llama.cpp's) straight into a litgpt GPT, its linears kept quantized.

Each block linear and the head stored in a format with a native kernel (quantized.FORMATS: the quantized blocks,
and F16/BF16 as they are) becomes a QuantizedLinear holding the file's bytes (Q/K rows put back in litgpt's RoPE
order, a row permutation that leaves blocks whole; q, k and v fused into litgpt's qkv when they share a format,
else a QuantizedParts of the three; Qwen2's q, k and v biases fused as they are, its rows not permuted; a head
tied to the embedding takes the embedding's blocks); every other tensor (norms, the embedding, formats without a
kernel) is dequantized to float32 as `gguf_convert` does. The tokenizer and chat template come from the file's
metadata. `gguf` and `tokenizers` are imported only here.
"""

from __future__ import annotations

import re
import tempfile
from collections import defaultdict
from pathlib import Path

import gguf
import litgpt
import numpy as np
import torch

from thunder_batch import gguf_convert, quantized
from thunder_batch.gguf_convert import _BLOCK_MAP, _GLOBAL_MAP, read_field, unpermute_rope_rows


def load_gguf(path: Path | str, dtype: torch.dtype = torch.float32, device="cpu", model_name: str | None = None):
    """(GPT, litgpt Tokenizer, Config) from a GGUF file. float32 keeps the quantized linears quantized; another
    dtype dequantizes every tensor (quantized linears run float32 activations only)."""
    from thunder_batch.text_encoding import TextEncoder

    path = Path(path)
    reader = gguf.GGUFReader(path, mode="c")  # copy-on-write: kept blocks are the file's pages, writable
    arch = gguf_convert.check_architecture(reader, path)
    config = config_for(reader, path, model_name)
    _rope_scaling(reader, config)
    state, kinds = quantized_state(reader, config, keep=dtype == torch.float32, arch=arch)
    model = _build(config, kinds, state, device)
    model = model.to(dtype=dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp) / config.name.replace("/", "_")  # litgpt keys BOS handling on the dir's name
        files.mkdir()
        gguf_convert.build_tokenizer(reader).save(str(files / "tokenizer.json"))
        gguf_convert._write_json(files / "tokenizer_config.json", gguf_convert.tokenizer_config(reader, config))
        gguf_convert._write_json(files / "generation_config.json", gguf_convert.generation_config(reader))
        tokenizer = litgpt.Tokenizer(files)
        tokenizer.text_encoder = TextEncoder.for_checkpoint(files, tokenizer)
    return model, tokenizer, config


def config_for(reader, path: Path, model_name: str | None = None) -> litgpt.Config:
    """litgpt's config named `model_name`, else the one the file's name or general.name names, when it matches the
    file's hyperparameters; else a llama config built from them (named after general.name or the file)."""
    names = [model_name, path.name.split(".")[0], read_field(reader, "general.name")]
    for name in filter(None, names):
        try:
            config = litgpt.Config.from_name(name)
        except ValueError:
            continue
        try:
            gguf_convert.check_config_matches(reader, config)
            return config
        except ValueError:
            if name == model_name:  # asked for by name: its mismatch is the answer
                raise
    return _config_from_metadata(reader, names[2] or names[1])


# Llama 3.x's RoPE scaling in litgpt's names, but for its factor: a file's rope_freqs tensor holds only the result.
LLAMA3_ROPE_DEFAULTS = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)


def llama3_rope_factors(config: litgpt.Config) -> np.ndarray:
    """llama.cpp's `rope_freqs` of a llama3 RoPE scaling: each frequency's divisor [rope_n_elem / 2] (its converter's
    formula, over litgpt's rope_adjustments)."""
    a, dim = config.rope_adjustments, config.rope_n_elem
    freqs = 1.0 / (config.rope_base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    wavelen, old = 2 * np.pi / freqs, a["original_max_seq_len"]
    smooth = (old / wavelen - a["low_freq_factor"]) / (a["high_freq_factor"] - a["low_freq_factor"])
    between = 1 / ((1 - smooth) / a["factor"] + smooth)
    low_freq, high_freq = wavelen > old / a["low_freq_factor"], wavelen < old / a["high_freq_factor"]
    return np.where(high_freq, 1.0, np.where(low_freq, a["factor"], between)).astype(np.float32)


def _rope_scaling(reader, config: litgpt.Config) -> None:
    """The file's `rope_freqs` (a llama3 RoPE scaling) checked against the config's; a config built from metadata
    takes Llama 3.x's scaling with the file's factor. ValueError where they differ."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    factors = None if tensor is None else gguf_convert._dequantize(tensor).numpy()
    if factors is not None and config.rope_adjustments is None:
        config.rope_adjustments = dict(LLAMA3_ROPE_DEFAULTS, factor=float(factors.max()))
    if factors is None and config.rope_adjustments is None:
        return
    llama3 = set(config.rope_adjustments) == {
        "factor",
        *LLAMA3_ROPE_DEFAULTS,
    }  # litgpt's other kind (yarn) has no rope_freqs
    if factors is None or not llama3 or not np.allclose(llama3_rope_factors(config), factors, rtol=1e-5):
        raise ValueError(
            f"the file's RoPE scaling (rope_freqs) is not {config.name}'s rope_adjustments {config.rope_adjustments}"
        )


def _config_from_metadata(reader, name: str) -> litgpt.Config:
    arch = read_field(reader, "general.architecture")

    def stored(key: str, default=None):
        return read_field(reader, f"{arch}.{key}", default)

    n_head, n_embd = stored("attention.head_count"), stored("embedding_length")
    head_size = stored("attention.key_length", n_embd // n_head)
    vocab = stored("vocab_size") or len(read_field(reader, "tokenizer.ggml.tokens", []))
    config = litgpt.Config(
        name=name,
        block_size=stored("context_length"),
        vocab_size=vocab,
        padded_vocab_size=vocab,
        n_layer=stored("block_count"),
        n_embd=n_embd,
        n_head=n_head,
        head_size=head_size,
        n_query_groups=stored("attention.head_count_kv", n_head),
        intermediate_size=stored("feed_forward_length"),
        rope_base=stored("rope.freq_base", 10000.0),
        rotary_percentage=stored("rope.dimension_count", head_size) / head_size,
        norm_eps=stored("attention.layer_norm_rms_epsilon"),
        bias=False,
        attn_bias=arch == "qwen2",
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
    )
    gguf_convert.check_config_matches(reader, config)
    return config


def quantized_state(reader, config: litgpt.Config, keep: bool = True, arch: str = "llama") -> tuple[dict, dict]:
    """(litgpt state dict, {linear's module path: ggml type}): a kept linear's entry is its bytes, uint8 [out,
    row bytes]; every other tensor float32."""
    state: dict[str, torch.Tensor] = {}
    kinds: dict[str, int] = {}
    qkv: dict[int, dict[str, tuple]] = defaultdict(dict)
    qkv_bias: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
    heads: dict[str, tuple] = {}
    for t in reader.tensors:
        block = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        bias = re.fullmatch(r"blk\.(\d+)\.(attn_[qkv])\.bias", t.name)
        if bias:
            qkv_bias[int(bias[1])][bias[2]] = gguf_convert._dequantize(t)
        elif t.name == "output.weight" or t.name == "token_embd.weight":  # the head, or tied to the embedding
            heads[t.name] = weights, kind = _tensor(t, keep)
            if t.name == "token_embd.weight":  # dequantized once: the head's float32 copy, if it is one, is a clone
                state["transformer.wte.weight"] = weights.clone() if kind is None else gguf_convert._dequantize(t)
        elif t.name == "rope_freqs.weight":  # the config's RoPE scaling (checked by _rope_scaling)
            continue
        elif t.name in _GLOBAL_MAP:
            state[_GLOBAL_MAP[t.name]] = gguf_convert._dequantize(t)
        elif block and block[2] in ("attn_q", "attn_k", "attn_v"):
            qkv[int(block[1])][block[2]] = _tensor(t, keep)
        elif block and block[2] in _BLOCK_MAP:
            key = f"transformer.h.{block[1]}.{_BLOCK_MAP[block[2]]}"
            state[f"{key}.weight"], kind = _tensor(t, keep)
            if kind is not None:
                kinds[key] = kind
        else:
            raise ValueError(f"GGUF tensor {t.name!r} has no litgpt counterpart in this loader")
    for i, parts in qkv.items():
        biases = qkv_bias.get(i, {})
        if arch == "llama":  # llama.cpp's converter permuted q's and k's rows for its RoPE; qwen2's it did not
            parts, biases = _rope_order(parts, config), _rope_order(biases, config)
        _fuse_qkv(i, parts, biases, config, state, kinds)
    # llama.cpp omits output.weight when the head is the embedding; the head keeps that tensor's format.
    state["lm_head.weight"], kind = heads.get("output.weight") or heads["token_embd.weight"]
    if kind is not None:
        kinds["lm_head"] = kind
    return state, kinds


def _tensor(t, keep: bool) -> tuple[torch.Tensor, int | None]:
    """A GGUF tensor as (its bytes [out, row bytes], ggml type) where kept quantized, else (float32, None)."""
    kind = int(t.tensor_type)
    if keep and kind in quantized.FORMAT_NAMES and t.data.ndim == 2:  # a matrix (F16 norms are vectors)
        # The file's own pages (copy-on-write): resident once, as llama.cpp's mmap, and written only if edited. As
        # bytes [rows, row bytes] (the reader gives F16 as float16 [rows, in]).
        return torch.from_numpy(t.data.view(np.uint8)), kind
    return gguf_convert._dequantize(t), None


def _rope_order(parts: dict, config) -> dict:
    """llama files' q and k rows (weights as (tensor, kind), or biases) put back in litgpt's RoPE order."""
    heads = {"attn_q": config.n_head, "attn_k": config.n_query_groups}

    def back(name, part):
        if name not in heads:
            return part
        if isinstance(part, tuple):
            return unpermute_rope_rows(part[0], heads[name]), part[1]
        return unpermute_rope_rows(part, heads[name])

    return {name: back(name, part) for name, part in parts.items()}


def _fuse_qkv(i: int, parts: dict[str, tuple], biases: dict, config, state: dict, kinds: dict) -> None:
    """Block i's q, k, v ((tensor, kind) each, in litgpt's row order) and their biases, if any, as litgpt's qkv."""
    if len(parts) != 3 or len(biases) not in (0, 3):
        raise ValueError(f"block {i} lacks one of attn_q/attn_k/attn_v: found {sorted(parts)}, biases {sorted(biases)}")
    names = ("attn_q", "attn_k", "attn_v")
    rows = [parts[n][0] for n in names]  # litgpt's cat(q, k, v): [H*D + 2*G*D, C or row bytes]
    formats = tuple(parts[n][1] for n in names)
    key = f"transformer.h.{i}.attn.qkv"
    if len(set(formats)) == 1:
        state[f"{key}.weight"] = torch.cat(rows)
        if formats[0] is not None:
            kinds[key] = formats[0]
    elif None not in formats:  # formats differ (a Q4_K_M file's Q6_K attn_v): each part kept in its own
        kinds[key] = formats
        state |= {f"{key}.parts.{j}.weight": part for j, part in enumerate(rows)}
        state |= {f"{key}.parts.{j}.bias": biases[n] for j, n in enumerate(names) if biases}
        return
    else:  # a part without a kernel: all float32
        rows = [w if f is None else quantized.dequantize(w, f, config.n_embd) for w, f in zip(rows, formats)]
        state[f"{key}.weight"] = torch.cat(rows)
    if biases:
        state[f"{key}.bias"] = torch.cat([biases[n] for n in names])


def _build(config: litgpt.Config, kinds: dict[str, int], state: dict, device) -> litgpt.GPT:
    """The GPT with a QuantizedLinear at each path of `kinds`, its tensors `state`'s own (assigned, not copied:
    strict, shapes checked)."""
    with torch.device("meta"):
        model = litgpt.GPT(config)
        for path, kind in kinds.items():
            parent_name, _, leaf = path.rpartition(".")
            setattr(
                model.get_submodule(parent_name), leaf, _quantized_module(model.get_submodule(path), path, kind, state)
            )
    model.load_state_dict(state, strict=True, assign=True)
    model.cos, model.sin = model.rope_cache(device=torch.device("cpu"))  # litgpt's RoPE buffers, not in the state
    return model.to(device)


def _quantized_module(linear, path: str, kind: int | tuple[int, ...], state: dict):
    """The QuantizedLinear (or, for a tuple of formats, the QuantizedParts) taking `linear`'s place, its weights
    empty: `state`'s are assigned to them."""
    if isinstance(kind, tuple):
        weights = [state[f"{path}.parts.{j}.weight"] for j in range(len(kind))]
        biases = [None if linear.bias is None else torch.empty(w.shape[0]) for w in weights]
        return quantized.QuantizedParts(
            [
                quantized.QuantizedLinear(linear.in_features, w.shape[0], f, torch.empty(w.shape, dtype=torch.uint8), b)
                for w, f, b in zip(weights, kind, biases)
            ]
        )
    weight = torch.empty(state[f"{path}.weight"].shape, dtype=torch.uint8)
    bias = None if linear.bias is None else torch.empty(linear.out_features)
    return quantized.QuantizedLinear(linear.in_features, linear.out_features, kind, weight, bias)
