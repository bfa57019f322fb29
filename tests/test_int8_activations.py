"""The opt-in int8 path of the quantized linears (EngineConfig(int8_activations=True)): x is rounded to int8 per 32
values as torch's eager code rounds it; the kernel's integer dot products equal a float32 matmul of that
rounded x on the `gguf` package's dequantization up to summation order, for every format and row count; a compiled
engine scores text as the eager engine does, within what x's rounding allows; the mode is part of the compile cache's
key; bad settings are refused."""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams, quantized
from thunder_batch.checkpoints import bundled_gguf_path, default_checkpoint_dir, load_checkpoint
from thunder_batch.compile.cache import module_signature
from thunder_batch.config import ParamError

why_not = quantized.quantized_kernels()
pytestmark = pytest.mark.skipif(why_not is not None, reason=f"no native kernels: {why_not}")

ROWS = [1, 2, 3, 5, 8, 9, 16, 17, 33, 64]  # both sides of the integer path's 16 rows


def test_native_rounding_of_x_is_torchs():
    torch.manual_seed(0)
    x = torch.randn(9, 160) * torch.logspace(-6, 3, 9).unsqueeze(1)
    x[0, :32] = 0  # a block of zeros: d = 0, q = 0
    ties = torch.tensor([127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 126.5])  # d = 1: ties go to even
    x[1, 32:64] = torch.cat([ties, torch.zeros(24)])
    expected = quantized.int8_round_trip(x)
    got = torch.ops.thunder_batch.int8_round_trip(x)
    assert torch.equal(got, expected)  # every value (a zero's sign may differ: -0.4 rounds to -0 in torch)
    assert torch.equal(expected[0, :32], torch.zeros(32))
    assert expected[1, 32:40].tolist() == [127.0, 2.0, 4.0, -2.0, 0.0, 0.0, 2.0, 126.0]
    levels = expected.reshape(9, 5, 32) / expected.reshape(9, 5, 32).abs().amax(-1, keepdim=True) * 127
    assert torch.allclose(levels[2:], levels[2:].round(), atol=1e-3)  # at most 255 levels a block: int8


@pytest.mark.parametrize("name", [name for name in quantized.FORMATS if name not in quantized.FLOAT_FORMATS])
def test_integer_kernel_is_a_float32_matmul_on_the_rounded_x(name):
    weights = quantized.block_size(quantized.FORMATS[name])[0]
    out_features, in_features = 37, weights * (3 if weights == 256 else 7)
    kind = quantized.FORMATS[name]
    blocks = torch.from_numpy(quantized.random_blocks(name, out_features, in_features, seed=2))
    dense = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(kind)))
    dense = dense.reshape(out_features, in_features).double()
    bias = torch.randn(out_features)
    for rows in ROWS:
        x = torch.randn(rows, in_features) * 3
        rounded = quantized.int8_round_trip(x).double()
        got = torch.ops.thunder_batch.quantized_linear(x, blocks, bias, kind, in_features, True).double()
        exact = rounded @ dense.T + bias.double()
        scale = rounded.abs() @ dense.abs().T + bias.double().abs()
        assert ((got - exact).abs() <= 4e-6 * scale + 1e-30).all(), (name, rows)
        eager = quantized.quantized_linear(x, blocks, bias, kind, in_features, True).double()
        assert ((eager - exact).abs() <= 4e-6 * scale + 1e-30).all(), (name, rows)
        assert not torch.equal(rounded, x.double())  # the mode does round x


def scored(engine: Engine, sequences: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each sequence's token logprobs given those before it, and the most likely token at each position."""
    results = engine.generate(sequences, SamplingParams(max_new_tokens=1, temperature=0.0, prompt_logprobs=1))
    logprobs = [lp for r in results for lp in r.prompt_logprobs[1:]]
    return logprobs, [top[0][0] for r in results for top in r.prompt_top_logprobs[1:]]


def test_compiled_int8_engine_scores_as_eager_does_and_keys_its_own_cache():
    """The bundled Q4_1 file with int8 activations, compiled (the integer kernel) and eager (x rounded in torch, the
    package's dequantization, torch's linear), each scoring the same 8 prompts and 24 tokens of text after them.

    Not token for token: a rounding of x to int8 moves by a whole step when summation order moves x across a
    half step, so two correct int8 runs drift apart (measured: 0.04-0.07 nats a token on average, the same argmax
    at 97-99% of positions, as far as either is from the exact path). Asserted: that closeness, with margin; that
    the compiled engine does run the integer path (its scores leave the exact compiled engine's by far more than
    float32 rounding); and that its modules' signature, part of the compile cache's key, is not the exact path's.
    """
    gguf_file, shape = bundled_gguf_path(), dict(batch_size=4, max_seq_length=256)
    exact = Engine.from_checkpoint(gguf_file, EngineConfig(**shape))
    prompts = [[{"role": "user", "content": f"Tell me about {topic}."}] for topic in TOPICS]
    follow = exact.generate(prompts, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    sequences = [r.prompt_ids + r.token_ids for r in follow]
    runs = {"exact": scored(exact, sequences)}
    for mode in ("eager", "thunder"):
        engine = Engine.from_checkpoint(gguf_file, EngineConfig(**shape, compile=mode, int8_activations=True))
        layers = [m for m in engine.model.modules() if isinstance(m, quantized.QuantizedLinear)]
        assert layers and all(m.int8_activations for m in layers)
        runs[mode] = scored(engine, sequences)
    (compiled, compiled_top), (eager, eager_top) = runs["thunder"], runs["eager"]
    gaps = [abs(a - b) for a, b in zip(compiled, eager, strict=True)]
    assert len(gaps) > 8 * 30 and sum(gaps) / len(gaps) < 0.2  # measured 0.04-0.07
    assert sum(a == b for a, b in zip(compiled_top, eager_top, strict=True)) >= 0.9 * len(gaps)
    assert max(abs(a - b) for a, b in zip(compiled, runs["exact"][0])) > 0.01
    assert module_signature(engine.model) != module_signature(exact.model)
    assert not any(m.int8_activations for m in exact.model.modules() if isinstance(m, quantized.QuantizedLinear))


TOPICS = ["the moon", "bread", "rivers", "chess", "winter", "bees", "trains", "music"]


def test_bad_int8_settings_are_refused_by_name():
    with pytest.raises(ParamError, match="int8_activations must be None, True or False, got 'yes'"):
        EngineConfig(int8_activations="yes")
    model, tokenizer, _ = load_checkpoint(default_checkpoint_dir())
    with pytest.raises(ValueError, match="int8_activations needs quantized linears"):
        Engine(model, EngineConfig(int8_activations=True, compile="eager"), tokenizer)


def test_every_command_takes_the_switch_and_refuses_it_without_quantized_linears():
    base = [sys.executable, "-m", "thunder_batch.cli", "generate", "--prompt", "The capital of France is"]
    base += ["--compile", "eager", "--max_new_tokens", "6", "--max_seq_length", "64", "--prefill_chunk", "16"]
    done = subprocess.run([*base, "--checkpoint_dir", str(bundled_gguf_path()), "--int8_activations"], **RUN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[1] The capital of France is" in done.stdout
    done = subprocess.run([*base, "--int8_activations"], **RUN)  # the default float32 checkpoint
    assert done.returncode != 0 and "int8_activations needs quantized linears" in done.stderr


RUN = dict(capture_output=True, text=True, timeout=600)
