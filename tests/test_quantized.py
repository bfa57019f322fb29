"""Quantized linears: the native dequantization is the `gguf` package's bit for bit, the native kernel is a float32
matmul on it up to summation order, and a compiled engine on quantized weights (a GGUF file kept quantized, or a
model quantized as it loads) gives the same greedy tokens as its oracles."""

from __future__ import annotations

import gguf
import litgpt
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from thunder_batch import Engine, EngineConfig, SamplingParams, gguf_load, gguf_write, quantized
from thunder_batch.checkpoints import bundled_gguf_path, default_checkpoint_dir, load_checkpoint

why_not = quantized.quantized_kernels()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no native kernels: {why_not}")

ROWS = [1, 2, 3, 5, 8, 9, 16, 17, 33, 64]  # decode rows, both sides of the register path's 16, prompt lanes


def shape_for(name: str) -> tuple[int, int]:
    weights = max(32, quantized.block_size(quantized.FORMATS[name])[0])  # F16/BF16: the kernels' 32-weight granules
    return 37, weights * (3 if weights == 256 else 7)  # odd output count, a few blocks


@pytest.mark.parametrize("name", list(quantized.FORMATS))
def test_dequantize_is_the_gguf_packages_bit_for_bit(name):
    out_features, in_features = shape_for(name)
    blocks = quantized.random_blocks(name, out_features, in_features)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(quantized.FORMATS[name]))
    got = quantized.dequantize(torch.from_numpy(blocks), quantized.FORMATS[name], in_features)
    assert got.shape == (out_features, in_features)
    assert np.array_equal(got.numpy().view(np.uint32), expected.reshape(got.shape).view(np.uint32))


@pytest.mark.parametrize("name", list(quantized.FORMATS))
def test_kernel_is_a_float32_matmul_on_the_dequantized_weights(name):
    out_features, in_features = shape_for(name)
    blocks = torch.from_numpy(quantized.random_blocks(name, out_features, in_features, seed=1))
    dense = torch.from_numpy(
        gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(quantized.FORMATS[name]))
    ).reshape(out_features, in_features)
    bias = torch.randn(out_features)
    for rows in ROWS:
        x = torch.randn(rows, in_features)
        got = torch.ops.thunder_batch.quantized_linear(x, blocks, bias, quantized.FORMATS[name], in_features)
        exact = x.double() @ dense.double().T + bias.double()
        scale = x.double().abs() @ dense.double().abs().T + bias.double().abs()
        # float32 sums in another order: within a few units of float32 rounding of the sum of magnitudes
        assert ((got.double() - exact).abs() <= 4e-6 * scale + 1e-30).all(), (name, rows)


def test_quantized_linear_from_a_float_linear_is_the_gguf_round_trip():
    linear = torch.nn.Linear(64, 24, bias=True)
    layer = quantized.QuantizedLinear.from_linear(linear, quantized.FORMATS["q8_0"])
    x = torch.randn(3, 64)
    blocks = gguf.quants.quantize(linear.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
    dense = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    assert torch.equal(layer.weight, torch.from_numpy(blocks))
    assert torch.equal(layer(x), F.linear(x, dense, linear.bias))
    assert "format=q8_0" in repr(layer)


def test_bad_quantization_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="q8_0, q4_0, q4_1, q5_0, q5_1; got 'q4_k'"):
        EngineConfig(quantization="q4_k")
    model, tokenizer, _ = load_checkpoint(default_checkpoint_dir(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 activations"):
        Engine(model, EngineConfig(quantization="q8_0"), tokenizer)
    model, tokenizer, _ = load_checkpoint(default_checkpoint_dir())
    with pytest.raises(ValueError, match="add 'thunder_batch' to executors"):
        Engine(model, EngineConfig(quantization="q8_0", executors=("torch",)), tokenizer)


PROMPTS = ["The capital of France is", "def fibonacci(n):", [{"role": "user", "content": "Name three colors."}]]


def greedy_ids(engine: Engine, new_tokens: int = 16) -> list[list[int]]:
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=0.0))
    return [r.token_ids for r in results]


def test_compiled_quantized_model_equals_eager():
    """EngineConfig(quantization=...) on a float32 checkpoint: the compiled step (native kernel on the blocks)
    gives eager's tokens (the gguf package's dequantization and torch's linear)."""
    ids = {}
    for mode in ("eager", "thunder"):
        model, tokenizer, _ = load_checkpoint(default_checkpoint_dir())
        config = EngineConfig(batch_size=4, max_seq_length=256, compile=mode, quantization="q4_0")
        engine = Engine(model, config, tokenizer)
        assert sum(isinstance(m, quantized.QuantizedLinear) for m in model.modules()) == 5 * model.config.n_layer + 1
        ids[mode] = greedy_ids(engine)
    assert ids["thunder"] == ids["eager"]
    assert len(ids["thunder"][0]) == len(ids["thunder"][1]) == 16  # the chat prompt may end at its stop token


def test_gguf_file_kept_quantized_gives_the_dequantized_checkpoints_tokens():
    """The bundled Q4_1 file loads with its block linears as the file's own bytes (a quarter of float32's memory
    and less), and the compiled engine's greedy tokens equal the engine's on the same file dequantized to float32."""
    engine = Engine.from_checkpoint(bundled_gguf_path(), EngineConfig(batch_size=4, max_seq_length=256))
    layers = [m for m in engine.model.transformer.h.modules() if isinstance(m, quantized.QuantizedLinear)]
    assert len(layers) == 5 * engine.model.config.n_layer
    assert {quantized.FORMAT_NAMES[m.ggml_type] for m in layers} == {"q4_1"}
    assert quantized.FORMAT_NAMES[engine.model.lm_head.ggml_type] == "q8_0"  # tied: the embedding's blocks
    reader = gguf.GGUFReader(bundled_gguf_path())
    tensors = {t.name: t for t in reader.tensors}
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith("weight"))
    norm_bytes = sum(4 * int(t.n_elements) for t in reader.tensors if t.name.startswith("blk.") and "norm" in t.name)
    assert sum(m.weight.numel() for m in layers) == file_bytes - norm_bytes
    assert engine.model.lm_head.weight.numel() == int(tensors["token_embd.weight"].n_bytes)
    dense = Engine.from_checkpoint(default_checkpoint_dir(), EngineConfig(batch_size=4, max_seq_length=256))
    assert greedy_ids(engine) == greedy_ids(dense)


def tiny_llama(**overrides) -> litgpt.GPT:
    """A 2-layer llama of 320 tokens: written files copy the bytes_tokenizer's 258 (conftest), padded."""
    fields = dict(name="tiny-llama-test", block_size=256, vocab_size=320, padded_vocab_size=320, n_layer=2)
    fields |= dict(n_embd=64, n_head=4, n_query_groups=2, intermediate_size=96, bias=False, rope_base=10000)
    fields |= dict(rotary_percentage=1.0)  # a llama rotates every dimension (llama.cpp reads no other)
    fields |= dict(norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False)
    torch.manual_seed(0)
    return litgpt.GPT(litgpt.Config(**(fields | overrides))).eval()


def assert_same_state(model, loaded) -> None:
    """The same tensor names, and every tensor equal (blocks as bytes)."""
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def written_tokens(model, loaded, tokenizer, modes: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """12 greedy tokens for two short prompts: "source", the written model eager; each of `modes`, the loaded one."""
    prompts, params = [[5, 6, 7], [9, 10]], SamplingParams(12, temperature=0)
    runs = [("source", model, "eager"), *((mode, loaded, mode) for mode in modes)]
    ids = {}
    for key, gpt, mode in runs:
        engine = Engine(gpt, EngineConfig(batch_size=2, max_seq_length=64, compile=mode), tokenizer)
        ids[key] = [r.token_ids for r in engine.generate(prompts, params)]
    return ids


@pytest.mark.parametrize("file_format", ["q8_0", "q4_0", "f32"])
def test_a_written_gguf_loads_back_as_the_same_model(tmp_path, file_format, bytes_tokenizer):
    """gguf_write (what the bench gives llama.cpp) and gguf_load (what the engine reads) are inverses: the same
    blocks (Q/K rows permuted on the way out and back), norms and embedding, and the same greedy tokens."""
    model = tiny_llama()
    if file_format != "f32":
        quantized.quantize_model(model, file_format)
    path = gguf_write.write_gguf(model, tmp_path / "tiny.gguf", file_format, bytes_tokenizer)
    loaded, tokenizer, config = gguf_load.load_gguf(path)
    assert config.name == "tiny-llama-test" and config.n_query_groups == 2
    assert_same_state(model, loaded)
    ids = written_tokens(model, loaded, tokenizer, ("eager",))
    assert ids["eager"] == ids["source"] and len(ids["source"][0]) == 12


def test_update_weights_reaches_quantized_blocks_and_leaves_the_file_alone(tmp_path, bytes_tokenizer):
    """New blocks through Engine.update_weights reach the compiled step (its tokens become those of an eager engine
    on the new blocks), and blocks loaded from a file are its pages copy-on-write: the file is not written."""
    path = gguf_write.write_gguf(tiny_llama(), tmp_path / "tiny.gguf", "q8_0", bytes_tokenizer)
    file_bytes = path.read_bytes()
    loaded, tokenizer, _ = gguf_load.load_gguf(path)
    engine = Engine(loaded, EngineConfig(batch_size=2, max_seq_length=64), tokenizer)
    prompts, params = [[5, 6, 7], [9, 10]], SamplingParams(8, temperature=0)
    before = [r.token_ids for r in engine.generate(prompts, params)]
    name = "transformer.h.1.mlp.proj.weight"
    layer = loaded.get_submodule(name.removesuffix(".weight"))
    new = torch.from_numpy(quantized.random_blocks("q8_0", layer.out_features, layer.in_features, seed=7))
    engine.update_weights({name: new, "lm_head.weight": torch.flip(loaded.lm_head.weight, dims=[0])})
    after = [r.token_ids for r in engine.generate(prompts, params)]
    oracle = Engine(loaded, EngineConfig(batch_size=2, max_seq_length=64, compile="eager"), tokenizer)
    assert after == [r.token_ids for r in oracle.generate(prompts, params)]
    assert after != before
    assert torch.equal(layer.weight, new) and path.read_bytes() == file_bytes


def test_random_weights_build_a_named_config_with_the_default_tokenizer():
    """`--random_weights NAME` (every command's ModelOptions): a litgpt config at a real size, seeded, no download;
    a config whose vocabulary the default tokenizer does not fit is refused by name before anything is built."""
    from thunder_batch.cli.options import ModelOptions

    model, tokenizer, config, _ = ModelOptions(random_weights="SmolLM2-135M-Instruct").load_model()
    again, *_ = ModelOptions(random_weights="SmolLM2-135M-Instruct").load_model()
    assert config.name == "SmolLM2-135M-Instruct" and tokenizer.vocab_size == 49152
    assert torch.equal(model.transformer.h[0].mlp.proj.weight, again.transformer.h[0].mlp.proj.weight)
    half, *_ = ModelOptions(random_weights="SmolLM2-135M-Instruct", precision="bfloat16").load_model()
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(ValueError, match="TinyLlama-1.1B-Chat-v1.0 has 32000 tokens, fewer than"):
        ModelOptions(random_weights="TinyLlama-1.1B-Chat-v1.0").load_model()


def test_a_qkv_of_mixed_formats_stays_quantized_part_by_part(tmp_path, bytes_tokenizer):
    """A Q4_K_M file's qkv has q and k in one format and v in another: it loads as a QuantizedParts (each part the
    file's own blocks, none dequantized), writes back as the same tensors, and the compiled engine on it gives the
    eager engine's tokens, which are those of the model it was written from."""
    model = tiny_llama()
    for block in model.transformer.h:
        rows = torch.split(block.attn.qkv.weight.detach(), [64, 32, 32])  # q (4 heads of 16), k, v (2 groups)
        kinds = [quantized.FORMATS[name] for name in ("q4_0", "q4_0", "q8_0")]
        parts = [quantized.QuantizedLinear(64, len(w), f, quantized.quantize_weight(w, f)) for w, f in zip(rows, kinds)]
        block.attn.qkv = quantized.QuantizedParts(parts)
    quantized.quantize_model(model, "q4_0")
    path = gguf_write.write_gguf(model, tmp_path / "mixed.gguf", "q4_0", bytes_tokenizer)
    loaded, tokenizer, _ = gguf_load.load_gguf(path)
    qkv = loaded.transformer.h[1].attn.qkv
    assert isinstance(qkv, quantized.QuantizedParts)
    assert [quantized.FORMAT_NAMES[p.ggml_type] for p in qkv.parts] == ["q4_0", "q4_0", "q8_0"]
    assert_same_state(model, loaded)
    ids = written_tokens(model, loaded, tokenizer, ("eager", "thunder"))
    assert ids["thunder"] == ids["eager"] == ids["source"] and len(ids["source"][0]) == 12


@pytest.mark.parametrize("name", quantized.FLOAT_FORMATS)
def test_f16_and_bf16_linears_stay_as_they_are(tmp_path, name, bytes_tokenizer):
    """A GGUF's F16/BF16 linears load as the file's own 2-byte weights (half of float32's memory), not dequantized;
    the compiled engine on them gives the eager engine's tokens (the package's widening and torch's linear), which
    are those of the model they were written from."""
    model, kind = tiny_llama(), quantized.FORMATS[name]
    for block in model.transformer.h:
        for path in quantized.BLOCK_LINEARS:
            linear = block.get_submodule(path)
            rows = quantized.quantize_weight(linear.weight, kind) if name == "bf16" else linear.weight.detach().half()
            layer = quantized.QuantizedLinear(linear.in_features, linear.out_features, kind, rows.view(torch.uint8))
            parent, _, leaf = path.rpartition(".")
            setattr(block.get_submodule(parent), leaf, layer)
    path = gguf_write.write_gguf(model, tmp_path / f"tiny.{name}.gguf", "f32", bytes_tokenizer)
    loaded, tokenizer, _ = gguf_load.load_gguf(path)
    layers = [m for m in loaded.transformer.h.modules() if isinstance(m, quantized.QuantizedLinear)]
    assert len(layers) == 5 * 2 and {m.ggml_type for m in layers} == {kind}
    assert all(m.weight.dtype == torch.uint8 and m.weight.shape[1] == 2 * m.in_features for m in layers)
    assert_same_state(model, loaded)
    ids = written_tokens(model, loaded, tokenizer, ("eager", "thunder"))
    assert ids["thunder"] == ids["eager"] == ids["source"] and len(ids["source"][0]) == 12


@pytest.mark.parametrize("mixed", [False, True])
def test_a_qwen2_file_loads_with_its_qkv_bias(tmp_path, mixed, bytes_tokenizer):
    """llama.cpp's qwen2 layout (a bias on q, k and v; rows in the Hugging Face order, not permuted) written by
    gguf_write and read by gguf_load: the same tensors, biases included (part by part where q, k and v differ in
    format), and the compiled engine's tokens equal the eager engine's, which are those of the model written."""
    model = tiny_llama(name="tiny-qwen2-test", attn_bias=True)
    for block in model.transformer.h:
        with torch.no_grad():
            block.attn.qkv.bias.normal_(0, 0.5)
        if mixed:
            rows, biases = (torch.split(t.detach(), [64, 32, 32]) for t in (block.attn.qkv.weight, block.attn.qkv.bias))
            kinds = [quantized.FORMATS[name] for name in ("q4_0", "q4_0", "q8_0")]
            parts = [
                quantized.QuantizedLinear(64, len(w), f, quantized.quantize_weight(w, f), b)
                for w, f, b in zip(rows, kinds, biases)
            ]
            block.attn.qkv = quantized.QuantizedParts(parts)
    quantized.quantize_model(model, "q8_0")
    path = gguf_write.write_gguf(model, tmp_path / "tiny-qwen2.gguf", "q8_0", bytes_tokenizer)
    assert gguf_load.read_field(gguf.GGUFReader(path), "general.architecture") == "qwen2"
    loaded, tokenizer, config = gguf_load.load_gguf(path)
    assert config.attn_bias and not config.bias
    assert any(name.endswith("qkv.bias") or ".qkv.parts.2.bias" in name for name in loaded.state_dict())
    assert_same_state(model, loaded)
    ids = written_tokens(model, loaded, tokenizer, ("eager", "thunder"))
    assert ids["thunder"] == ids["eager"] == ids["source"] and len(ids["source"][0]) == 12


def test_the_qwen2_split_is_its_tokenizers():
    """A qwen2 file's tokenizer splits text as Qwen2's own (transformers' copy of its tokenizer.json regex)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    from thunder_batch import gguf_convert

    assert gguf_convert.QWEN2_SPLIT == PRETOKENIZE_REGEX
