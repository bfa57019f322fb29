"""Linears whose weights stay in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), or in its
F16/BF16 as they are.

A `QuantizedLinear` holds its weight as the file's bytes, uint8 [out, row bytes], and calls `quantized_linear`,
which eager code runs as the `gguf` package's dequantization followed by a float32 `F.linear` (the oracle), and
which the project's Thunder executor claims and runs as the native kernel reading the blocks in place
(native/quantized_linear.cpp: the same products, summed in another order). Activations stay float32.

A `QuantizedParts` is a linear whose rows come in parts of different formats (a GGUF qkv whose v is not in q's
format). `quantize_model` turns a litgpt GPT's block linears into QuantizedLinears of one format with the `gguf`
package's quantizers (those it has: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), the head too; GGUF files bring any of the formats
above (gguf_load.quantized_state). The embedding stays float32 (a step reads only its rows).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from thunder_batch.config import QUANTIZATIONS

# Name (as in --quantization and llama.cpp's file types) -> ggml type id (gguf.GGMLQuantizationType).
FORMATS = {
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q4_k": 12,
    "q5_k": 13,
    "q6_k": 14,
    "f16": 1,
    "bf16": 30,
}
# Float formats a GGUF's linears may keep (2 bytes a weight, widened exactly); the others are quantized blocks, which
# the integer path (int8_activations) also reads.
FLOAT_FORMATS = ("f16", "bf16")
# Formats the `gguf` package can make from float32 weights (the K-quants come only from files).
QUANTIZABLE = QUANTIZATIONS
FORMAT_NAMES = {v: k for k, v in FORMATS.items()}
# Block linears of a litgpt llama block: the ones quantized.
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")


def block_size(ggml_type: int) -> tuple[int, int]:
    """(weights, bytes) of one block of the format."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def quantized_linear(x, weight, bias, ggml_type: int, in_features: int, int8_activations: bool = False):
    """x [..., in] float32 @ dequantize(weight).T (+ bias) -> [..., out]; weight: uint8 [out, row bytes] of
    ggml type `ggml_type`. With `int8_activations`, x is first rounded to int8 blocks (`int8_round_trip`): the
    native kernel then multiplies integers. The project's executor replaces this call by the native kernel
    (compile.project_executor); under a torch function mode (the load check's eager side) the mode may do the same."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if has_torch_function(tensors):
        args = (x, weight, bias, ggml_type, in_features, int8_activations)
        return handle_torch_function(quantized_linear, tensors, *args)
    if int8_activations:
        x = int8_round_trip(x)
    return F.linear(x, dequantize(weight, ggml_type, in_features), bias)


def int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] float32 (in a multiple of 32) -> each 32 values as llama.cpp's int8 blocks make them and read back:
    d = max|x| / 127, round(x * (1 / d)) * d, ties to even (the native kernel's rounding: the same values)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inverse) * d).reshape(x.shape)


def dequantize(weight: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """uint8 [out, row bytes] -> float32 [out, in], bit for bit the `gguf` package's dequantization (the native
    one where the kernels are built; tests/test_quantized.py holds them equal)."""
    if quantized_kernels() is None:
        return torch.ops.thunder_batch.dequantize(weight.contiguous(), ggml_type, in_features)
    import gguf

    rows = gguf.quants.dequantize(weight.cpu().numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(weight.shape[0], in_features)


def quantized_kernels() -> str | None:
    """Why the native quantized kernels cannot run here (None: they can): the native build and F16C are needed."""
    from thunder_batch.native import build

    if (why := build.unavailable()) is not None:
        return why
    return None if "f16c" in build.cpu_flags() else "this CPU has no F16C"


def quantize_weight(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [out, in] -> uint8 [out, row bytes] with the `gguf` package's quantizer (as llama.cpp's)."""
    import gguf

    rows = w.detach().to(torch.float32).cpu().numpy()
    return torch.from_numpy(gguf.quants.quantize(rows, gguf.GGMLQuantizationType(ggml_type)))


class QuantizedLinear(nn.Module):
    """nn.Linear's place in a litgpt block, its weight kept as quantized blocks: `weight` uint8 [out, row
    bytes] (a frozen Parameter, so the engine's weight watch follows it like any other), `bias` float32 or None."""

    def __init__(self, in_features: int, out_features: int, ggml_type: int, weight: torch.Tensor, bias=None):
        super().__init__()
        weights, nbytes = block_size(ggml_type)
        if in_features % weights:
            raise ValueError(
                f"{FORMAT_NAMES[ggml_type]} needs in_features in multiples of {weights}, got {in_features}"
            )
        expected = (out_features, in_features // weights * nbytes)
        if weight.dtype != torch.uint8 or tuple(weight.shape) != expected:
            got = f"{weight.dtype} {list(weight.shape)}"
            raise ValueError(f"quantized weight must be uint8 {list(expected)}, got {got}")
        self.in_features, self.out_features, self.ggml_type = in_features, out_features, ggml_type
        self.int8_activations = False  # the integer path (set_int8_activations, EngineConfig.int8_activations)
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ggml_type: int) -> QuantizedLinear:
        weight = quantize_weight(linear.weight, ggml_type)
        return cls(linear.in_features, linear.out_features, ggml_type, weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.ggml_type, self.in_features, self.int8_activations)

    def extra_repr(self) -> str:  # part of the compile cache's key
        kind = FORMAT_NAMES.get(self.ggml_type, self.ggml_type)
        int8 = ", int8_activations=True" if self.int8_activations else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, format={kind}{int8}"


class QuantizedParts(nn.Module):
    """A linear whose output rows come in parts of different formats, each a QuantizedLinear (a Q4_K_M file's qkv:
    q and k in Q4_K, v in Q6_K; Qwen2's with its bias part by part): the parts' outputs side by side,
    [..., sum of out_features]."""

    def __init__(self, parts: list[QuantizedLinear]):
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a linear share in_features")
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def format_id(name: str, *, to_make: bool = False) -> int:
    """The ggml type id of a format name; ValueError naming the choices otherwise."""
    choices = QUANTIZABLE if to_make else tuple(FORMATS)
    if name not in choices:
        raise ValueError(f"quantization must be one of {', '.join(choices)}; got {name!r}")
    return FORMATS[name]


@torch.no_grad()
def quantize_model(gpt, name: str) -> int:
    """Replaces each block's float32 linears and the head by QuantizedLinears of format `name` (in place); returns
    how many. Linears whose input width is not a multiple of the format's block stay float32."""
    ggml_type = format_id(name, to_make=True)
    if gpt.transformer.wte.weight.dtype != torch.float32:
        raise ValueError(f"quantized linears run float32 activations; the model is {gpt.transformer.wte.weight.dtype}")
    paths = [f"transformer.h.{i}.{path}" for i in range(len(gpt.transformer.h)) for path in BLOCK_LINEARS]
    done = 0
    for path in [*paths, "lm_head"]:
        parent_name, _, leaf = path.rpartition(".")
        parent = gpt.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        if type(linear) is nn.Linear and linear.in_features % block_size(ggml_type)[0] == 0:
            setattr(parent, leaf, QuantizedLinear.from_linear(linear, ggml_type))
            done += 1
    return done


def set_int8_activations(gpt, on: bool) -> None:
    """Switches the model's quantized linears to (or off) the integer path: x rounded to int8 per 32 values."""
    for linear in gpt.modules():
        if isinstance(linear, QuantizedLinear):
            linear.int8_activations = on and FORMAT_NAMES[linear.ggml_type] not in FLOAT_FORMATS


def is_quantized(gpt) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in gpt.modules())


def check_quantized(gpt, config) -> None:
    """Quantizes `gpt` as `config.quantization` asks, then checks its quantized linears can run as configured:
    on CPU, float32, and (compiled) with the project's executor and its native kernels. ValueError naming why."""
    if config.quantization is not None:
        quantize_model(gpt, config.quantization)
    linears = [m for m in gpt.modules() if isinstance(m, QuantizedLinear)]
    if config.int8_activations and not linears:
        raise ValueError("int8_activations needs quantized linears: a GGUF file or EngineConfig(quantization=...)")
    if config.int8_activations is not None:
        set_int8_activations(gpt, config.int8_activations)
    if not linears:
        return
    device, dtype = gpt.transformer.wte.weight.device, gpt.transformer.wte.weight.dtype
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"quantized linears run on CPU with float32 activations; the model is {dtype} on {device}")
    if config.compile == "eager":
        return
    if config.executors is not None and "thunder_batch" not in config.executors:
        raise ValueError("quantized linears run on the project's executor: add 'thunder_batch' to executors")
    if (why := quantized_kernels()) is not None:
        raise ValueError(f"quantized linears need the native kernels: {why}")


K_SCALES = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}  # byte offsets of a K-quant block's float16 scales


def random_blocks(name: str, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """uint8 [out, row bytes] of format `name`: the gguf package's quantization of random weights, or (K-quants,
    which it cannot make) random bytes with small finite float16 scales."""
    import gguf

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType(FORMATS[name])
    if name == "f16":
        return rng.standard_normal((out_features, in_features)).astype(np.float16).view(np.uint8)
    if name in QUANTIZABLE or name == "bf16":
        return gguf.quants.quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), kind)
    weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (out_features, in_features // weights, nbytes), dtype=np.uint8)
    for offset in K_SCALES[name]:
        scales = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)
