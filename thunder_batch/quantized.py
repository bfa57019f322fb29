"""Linears whose weights stay in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K).

A `QuantizedLinear` holds its weight as the file's bytes, uint8 [out, row bytes], and calls `quantized_linear`,
which eager code runs as the `gguf` package's dequantization followed by a float32 `F.linear` (the oracle), and
which the project's Thunder executor claims and runs as the native kernel reading the blocks in place
(native/quantized_linear.cpp: the same products, summed in another order). Activations stay float32.

`quantize_model` turns a litgpt GPT's block linears into QuantizedLinears of one format with the `gguf`
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
FORMATS = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14}
# Formats the `gguf` package can make from float32 weights (the K-quants come only from files).
QUANTIZABLE = QUANTIZATIONS
FORMAT_NAMES = {v: k for k, v in FORMATS.items()}
# Block linears of a litgpt llama block: the ones quantized.
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj")


def block_size(ggml_type: int) -> tuple[int, int]:
    """(weights, bytes) of one block of the format."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def quantized_linear(x, weight, bias, ggml_type: int, in_features: int) -> torch.Tensor:
    """x [..., in] float32 @ dequantize(weight).T (+ bias) -> [..., out]; weight: uint8 [out, row bytes] of
    ggml type `ggml_type`. The project's executor replaces this call by the native kernel (compile.
    project_executor); under a torch function mode (the load check's eager side) the mode may do the same."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if has_torch_function(tensors):
        return handle_torch_function(quantized_linear, tensors, x, weight, bias, ggml_type, in_features)
    return F.linear(x, dequantize(weight, ggml_type, in_features), bias)


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
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, ggml_type: int) -> QuantizedLinear:
        weight = quantize_weight(linear.weight, ggml_type)
        return cls(linear.in_features, linear.out_features, ggml_type, weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias, self.ggml_type, self.in_features)

    def extra_repr(self) -> str:
        kind = FORMAT_NAMES.get(self.ggml_type, self.ggml_type)
        return f"in_features={self.in_features}, out_features={self.out_features}, format={kind}"


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


def is_quantized(gpt) -> bool:
    return any(isinstance(m, QuantizedLinear) for m in gpt.modules())


def check_quantized(gpt, config) -> None:
    """Quantizes `gpt` as `config.quantization` asks, then checks its quantized linears can run as configured:
    on CPU, float32, and (compiled) with the project's executor and its native kernels. ValueError naming why."""
    if config.quantization is not None:
        quantize_model(gpt, config.quantization)
    if not is_quantized(gpt):
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
    if name in QUANTIZABLE:
        return gguf.quants.quantize(rng.standard_normal((out_features, in_features)).astype(np.float32), kind)
    weights, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (out_features, in_features // weights, nbytes), dtype=np.uint8)
    for offset in K_SCALES[name]:
        scales = rng.uniform(-0.05, 0.05, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)
