"""GGUF files written for llama.cpp (gguf_write) and read by the engine (gguf_load) beyond the formats test_quantized
covers: f16/bf16 files, a vocabulary larger than the tokenizer's, Llama 3's RoPE scaling, llama.cpp's K-quant mixes of
random blocks (what `--random_weights NAME --quantization q4_k_m` runs); and the file the bench gives llama.cpp for
each model (bench.llama_cpp_files), whose server's own memory it reports."""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import gguf
import litgpt
import pytest
import torch

from thunder_batch import gguf_load, gguf_write, quantized
from thunder_batch.bench import llama_cpp
from thunder_batch.bench.llama_cpp_files import LlamaCppFiles, file_formats, file_label, model_formats

LLAMA3_ROPE = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8192)
VOCAB = 320  # the models' vocabulary: the bytes_tokenizer's 258 tokens (conftest), padded in written files


def tiny(**overrides) -> litgpt.GPT:
    """A 2-layer llama with a vocabulary of VOCAB tokens."""
    fields = dict(name="tiny-llama-files", block_size=256, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2)
    fields |= dict(n_embd=64, n_head=4, n_query_groups=2, intermediate_size=96, bias=False, rope_base=10000)
    fields |= dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False, rotary_percentage=1.0)
    torch.manual_seed(0)
    return litgpt.GPT(litgpt.Config(**(fields | overrides))).eval()


def kinds(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("file_format", ["bf16", "f16"])
def test_a_float_file_holds_the_models_weights_rounded_to_its_format(tmp_path, file_format, bytes_tokenizer):
    model = tiny()
    path = gguf_write.write_gguf(model, tmp_path / "tiny.gguf", file_format, bytes_tokenizer)
    assert file_formats(path) == {file_format} and file_label(path) == file_format
    loaded, _, _ = gguf_load.load_gguf(path)
    dtype = torch.bfloat16 if file_format == "bf16" else torch.float16
    for name in ["lm_head", *(f"transformer.h.1.{p}" for p in quantized.BLOCK_LINEARS)]:
        layer = loaded.get_submodule(name)  # the file's 2-byte weights, kept as they are
        widened = quantized.dequantize(layer.weight, layer.ggml_type, layer.in_features)
        assert torch.equal(widened, model.get_submodule(name).weight.detach().to(dtype).float()), name
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight.detach().to(dtype).float())


def test_a_llama3_file_with_a_larger_vocabulary_gives_the_models_logits(tmp_path, bytes_tokenizer):
    """Llama 3's RoPE scaling goes into the file as llama.cpp's rope_freqs and comes back as the config's scaling;
    a vocabulary larger than the tokenizer's pads its token list. The loaded model's logits are the written one's."""
    model = tiny(name="tiny-llama3", rope_adjustments=LLAMA3_ROPE)
    path = gguf_write.write_gguf(model, tmp_path / "tiny.gguf", "f32", bytes_tokenizer)
    tokens = gguf_load.read_field(gguf.GGUFReader(path), "tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and tokens[257:259] == ["<|endoftext|>", "[PAD258]"]
    assert "rope_freqs.weight" in kinds(path)
    loaded, _, config = gguf_load.load_gguf(path)
    assert config.rope_adjustments == LLAMA3_ROPE and config.padded_vocab_size == VOCAB
    idx = torch.tensor([[5, 6, 7, 300, 90]])
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
        unscaled = copy.deepcopy(model)
        unscaled.config.rope_adjustments = None
        unscaled.cos, unscaled.sin = unscaled.rope_cache()  # without the scaling
        assert not torch.equal(unscaled(idx), model(idx))  # the scaling matters to these logits


def test_a_rope_scaling_other_than_llama3s_is_refused_not_run_wrong(tmp_path, bytes_tokenizer):
    odd = tiny(name="tiny-odd-rope", rope_adjustments=dict(LLAMA3_ROPE, original_max_seq_len=4096))
    path = gguf_write.write_gguf(odd, tmp_path / "odd.gguf", "f32", bytes_tokenizer)  # rope_freqs hold the factors
    with pytest.raises(ValueError, match="RoPE scaling"):
        gguf_load.load_gguf(path)


def test_a_random_q4_k_m_file_is_llama_cpps_mix_and_loads_as_it_is(tmp_path, bytes_tokenizer):
    """llama.cpp's Q4_K_M: Q4_K, with attn_v and ffn_down in Q6_K on its "more bits" layers (0, 3, 6, 7 of 8), the
    head in Q6_K; a width 256 does not divide falls back as its quantizer does (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    config = tiny(n_layer=8, n_embd=256, head_size=64, intermediate_size=320).config
    path = gguf_write.write_random_gguf(config, tmp_path / "tiny.q4_k_m.gguf", "q4_k_m", tokenizer_from=bytes_tokenizer)
    types = kinds(path)
    more_bits = {0, 3, 6, 7}
    assert [types[f"blk.{i}.attn_v.weight"] for i in range(8)] == [
        "Q6_K" if i in more_bits else "Q4_K" for i in range(8)
    ]
    assert [types[f"blk.{i}.ffn_down.weight"] for i in range(8)] == [
        "Q8_0" if i in more_bits else "Q5_0" for i in range(8)
    ]
    assert types["output.weight"] == "Q6_K" and types["blk.2.ffn_up.weight"] == types["token_embd.weight"] == "Q4_K"
    assert file_label(path) == "q4_k_m"
    loaded, _, _ = gguf_load.load_gguf(path)
    assert model_formats(loaded) == file_formats(path) == {"q4_k", "q6_k", "q5_0", "q8_0"}
    assert isinstance(loaded.transformer.h[0].attn.qkv, quantized.QuantizedParts)  # v in another format
    with torch.no_grad():
        assert loaded(torch.tensor([[5, 6, 7]])).isfinite().all()


def test_the_bench_gives_llama_cpp_a_file_in_the_models_own_formats(tmp_path, bytes_tokenizer):
    """A given file serves the model whose linears are in its formats; any other model is written (float weights in
    its precision, blocks as they are); a layout llama.cpp's llama file cannot hold is refused by name."""
    model = tiny()
    q8 = copy.deepcopy(model)
    quantized.quantize_model(q8, "q8_0")
    given = gguf_write.write_gguf(q8, tmp_path / "given.gguf", "q8_0", bytes_tokenizer)
    (tmp_path / "written").mkdir()
    files = LlamaCppFiles(str(given), tmp_path / "written", bytes_tokenizer)
    assert files.for_model(q8) == str(given)
    written = files.for_model(model)
    assert written != str(given) and model_formats(model) == file_formats(written) == {"f32"}
    assert file_formats(files.for_model(copy.deepcopy(model).to(torch.bfloat16))) == {"bf16"}
    neox = litgpt.GPT(litgpt.Config.from_name("pythia-14m", n_layer=1))
    with pytest.raises(ValueError, match="not in a llama or qwen2 layout"):
        files.for_model(neox)


def test_llama_cpp_needs_only_a_build_and_its_servers_own_peak_memory_is_read(tmp_path, monkeypatch):
    monkeypatch.delenv(llama_cpp.ENV_VAR, raising=False)
    assert "--llama_cpp_bin" in llama_cpp.unavailable(None, None)
    (tmp_path / "llama-server").touch()
    assert llama_cpp.unavailable(str(tmp_path), None) is None
    assert "not found" in llama_cpp.unavailable(str(tmp_path), str(tmp_path / "none.gguf"))
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(300 * 2**20); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 60
        while (llama_cpp.peak_rss_mb(child.pid) or 0) < 300 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 300 <= llama_cpp.peak_rss_mb(child.pid) < 1000
    finally:
        child.kill()
        child.wait()


def test_random_k_quant_weights_load_from_their_file_which_the_bench_gives_llama_cpp(tmp_path):
    """`--random_weights NAME --quantization q4_k_m`: the model is loaded from a written Q4_K_M file (kept in the
    bench's folder), made by no quantizer; without --random_weights a K-quant is refused by name."""
    from thunder_batch.cli.bench import BenchFlags, model_files
    from thunder_batch.cli.options import EngineOptions

    command = BenchFlags(random_weights="SmolLM2-135M-Instruct", quantization="q4_k_m")
    model, _, config, checkpoint_dir = command.load_model("cpu", tmp_path)
    [path] = tmp_path.glob("*.gguf")
    assert config.name == "SmolLM2-135M-Instruct" and file_label(path) == "q4_k_m"
    assert model_formats(model) == file_formats(path) >= {"q4_k", "q6_k", "q5_0"}  # 576 wide: Q4_K falls back
    assert model_files(command, checkpoint_dir, tmp_path) == str(path)
    assert (
        EngineOptions(random_weights="SmolLM2-135M-Instruct", quantization="q4_k_m").engine_config().quantization
        is None
    )
    with pytest.raises(ValueError, match="only with --random_weights"):
        BenchFlags(quantization="q4_k_m").load_model()


@pytest.mark.parametrize("pre", ["llama-bpe", "default"])
def test_a_llama3_tokenizer_takes_a_word_its_vocabulary_holds_whole(tmp_path, pre):
    """Llama 3 files (pre "llama-bpe"): its own split (transformers' tiktoken pattern, three digits at a time), and
    a word found whole in the vocabulary is one token though no merge makes it (ignore_merges, as llama.cpp)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from thunder_batch import gguf_convert

    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["h", "e", "l", "o", "1", "2", "3", "4", "he", "hello", "123"])
    writer.add_token_merges(["h e"])
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    tokenizer = gguf_convert.build_tokenizer(gguf.GGUFReader(tmp_path / "tok.gguf"))
    whole = pre == "llama-bpe"
    assert tokenizer.encode("hello").ids == ([9] if whole else [8, 2, 2, 3])
    assert tokenizer.encode("1234").ids == ([10, 7] if whole else [4, 5, 6, 7])
    assert gguf_convert.LLAMA3_SPLIT == TikTokenConverter.__init__.__defaults__[1]
