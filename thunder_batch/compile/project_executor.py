"""The project's own Thunder executor, named "thunder_batch": the ops it claims from traced programs.
Besides the linears below, a decode step's attention (`attention`) and the in-place KV cache writes
(`inplace`).

It claims `linear` on CPU. On an AVX2 CPU without AVX-512 it reads float32 and bfloat16 weights in their
own layout [out, in] (`plain_linear`: as fast as the packed kernels at a decode step's rows; a 1.7B float32
model's 512-token prompt ran at 0.82-0.95x; RESULTS.md "One copy of the weights"), so a compiled model holds
each weight once. Elsewhere it runs a linear from a copy of the weight packed once, in the layout the kernel reads as
one stream. The speeds below are measured with benchmarks/linear_bandwidth.py in
benchmarks/RESULTS.md: "AVX2: the native kernels on every x86-64 CPU", "Prompt steps on the native
kernel" (AVX2), "bf16 linears on AMX tiles" parts 1 and 3 (AMX, and float32 on AVX-512F):
- float32, at most `packed_rows(float32)` rows: the project's kernel (thunder_batch.native), faster than
  torch's at decode rows; larger float32 linears stay with torch. On AVX-512F it beats torch's GEMM up to
  64 rows (a 2-core Xeon); on an AVX2-only CPU the kernel is faster than torch's at any rows (decode rows
  and a prompt step's 136-520 alike), so it takes them all.
- bfloat16 on a CPU with AMX-BF16 (`in` a multiple of 32), any rows: the project's AMX kernel on the
  same packed weight: faster than the `vdpbf16ps` kernel from 8 rows (as fast at 1), and than torch's
  GEMM at 32-520 rows.
- bfloat16 on a CPU with AVX512-BF16 otherwise, at most PACKED_ROWS[bfloat16] rows: the project's `vdpbf16ps`
  kernel (float32 accumulation, one rounding: equal to torch's result but for the last bit of a few
  outputs); larger ones stay with torch.
- bfloat16 where oneDNN runs bf16 (AVX512-BW/VL/DQ or AVX-NE-CONVERT) but the CPU lacks AVX512-BF16,
  any rows: oneDNN's linear on its own blocked layout (`_reorder_linear_weight`), the same result as
  torch's bit for bit, faster at the rows of a decode step (RESULTS.md "The fused step").
- bfloat16 on an AVX2-only CPU, any rows: the project's kernel widening the weights to float32 (torch's
  bf16 GEMM there is slower at every row count measured; float32 accumulation, one rounding).
Where they are made, the packed copies live beside the weights (one more copy of each claimed weight) and
are redone when a weight is changed in place. The eager engine never uses them: they are what compiling adds.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from thunder_batch import fallbacks, model, quantized
from thunder_batch._compat import import_thunder
from thunder_batch.compile import attention, block_op, controls_op

EXECUTOR = "thunder_batch"
LINEAR = "thunder_batch_packed_linear"
QUANTIZED_LINEAR = "thunder_batch_quantized_linear"
# AVX-512: the most rows a native kernel takes, per dtype; above them torch's GEMM is as fast or faster
# (benchmarks/RESULTS.md: float32 on a Xeon, 2026-12-04; vdpbf16ps on Zen 5 and a Xeon).
PACKED_ROWS = {torch.float32: 64, torch.bfloat16: 16}


def project_executor():
    """The "thunder_batch" OperatorExecutor, registered with Thunder on first use, with `packed_linear`
    as `linear`'s implementation (the in-place KV cache write ops are added by `inplace`)."""
    import_thunder()
    from thunder.extend import OperatorExecutor, get_executor, register_executor

    executor = get_executor(EXECUTOR)
    if executor is None:
        executor = OperatorExecutor(EXECUTOR, version="1")
        register_executor(executor)
    if LINEAR not in executor.opmap:
        import thunder.torch as ltorch

        op = executor.register_operator(LINEAR, meta=_linear_meta, fn=packed_linear)
        executor.register_implementation(ltorch.linear, op, checker=_claims)
    if QUANTIZED_LINEAR not in executor.opmap:
        executor.register_operator(
            QUANTIZED_LINEAR, meta=_quantized_meta, fn=native_quantized_linear, replaces=quantized.quantized_linear
        )
    attention.register(executor)
    controls_op.register(executor)
    block_op.register(executor, decode_block)
    return executor


class PackedWeights:
    """weight -> (its packed copy, the kernel that reads it), made on first use and redone when the
    weight changes in place (`_version`); an entry goes with its weight. A lookup is a dict read: it
    runs for every linear of every step. Where `own_layout(w)`, the "copy" is the weight itself (a
    detached view of its memory) and `plain_linear` reads it: nothing is copied."""

    def __init__(self) -> None:
        self._packed: dict[int, tuple] = {}  # id(w) -> (weakref to w, w._version, packed, kernel)

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, Callable]:
        entry = self._packed.get(id(w))
        if entry is None or entry[0]() is not w or entry[1] != w._version:
            forget = functools.partial(self._packed.pop, id(w), None)
            entry = (weakref.ref(w, lambda _: forget()), w._version, *self._pack(w.detach()))
            self._packed[id(w)] = entry
        return entry[2], entry[3]

    def holds(self, w: torch.Tensor) -> bool:
        """Whether `w`'s packed copy is made and current."""
        entry = self._packed.get(id(w))
        return entry is not None and entry[0]() is w and entry[1] == w._version

    def sources(self) -> dict[int, torch.Tensor]:
        """id(packed copy) -> the live weight it is the current copy of."""
        entries = [(entry[0](), entry) for entry in self._packed.values()]
        return {id(entry[2]): w for w, entry in entries if w is not None and entry[1] == w._version}

    def refresh(self, weights) -> None:
        """Packs again, now, each of `weights` that has a packed copy (new values, or new data under it): into
        the copy's own memory where the kernel is the project's (no allocation, much faster than a new copy:
        benchmarks/RESULTS.md, "Numbers moved from the code's comments"); a weight read in its own layout
        is only looked at again (new data under it is a new view)."""
        for w in weights:
            entry = self._packed.get(id(w))
            if entry is None or entry[0]() is not w:
                continue
            if entry[3] is _plain_kernel():
                view = entry[2] if entry[2].data_ptr() == w.data_ptr() else w.detach()
                self._packed[id(w)] = (entry[0], w._version, view, entry[3])
            elif _repack_into(w.detach(), entry[2], entry[3]):
                self._packed[id(w)] = (entry[0], w._version, *entry[2:])
            else:
                del self._packed[id(w)]
                self.get(w)

    def pack_as(self, done: list, todo: list) -> None:
        """Packs each weight of `todo` whose counterpart in `done` (another layer's inputs to the same
        program, in the same order) is packed: a layer bound without running gets what it will read."""
        for ran, bound in zip(done, todo, strict=True):
            if isinstance(ran, torch.Tensor) and isinstance(bound, torch.Tensor) and self.holds(ran):
                self.get(bound)

    @staticmethod
    def _pack(w: torch.Tensor) -> tuple[torch.Tensor, Callable]:
        from thunder_batch.native import build

        if own_layout(w):
            return w, _plain_kernel()
        if w.dtype == torch.float32:
            return build.pack_linear_weight(w), torch.ops.thunder_batch.packed_linear.default
        if native_bf16(w.shape[1]):
            return build.pack_linear_weight_bf16(w), torch.ops.thunder_batch.packed_linear_bf16.default
        return torch.ops.mkldnn._reorder_linear_weight(w, 1), _onednn_linear


PACKED = PackedWeights()  # packed copies of weights, shared by every program of the process


def _plain_kernel() -> Callable:
    return torch.ops.thunder_batch.plain_linear.default


def own_layout(w: torch.Tensor) -> bool:
    """Whether the project's executor reads this CPU weight in its own layout (`plain_linear`, no packed copy):
    contiguous float32 or bfloat16 on a CPU whose fastest native kernel is AVX2 for that dtype (no AVX-512F;
    for bfloat16, no AVX512-BF16, where the bf16 kernel widens to float32)."""
    from thunder_batch.native.build import cpu_flags, unavailable

    if not w.is_contiguous() or w.dim() != 2 or unavailable() is not None:
        return False
    if w.dtype == torch.float32:
        return "avx512f" not in cpu_flags()
    return w.dtype == torch.bfloat16 and native_bf16(w.shape[1]) and "avx512_bf16" not in cpu_flags()


@torch.no_grad()
def _repack_into(w: torch.Tensor, packed: torch.Tensor, kernel: Callable) -> bool:
    """Writes `w` [O, I] into `packed` in the native kernels' layouts (float32 [blocks, I, 16], bfloat16
    [blocks, I/2, 16, 2]: row b * 16 + r of w is lane r of block b; the padding rows stay zero). False for
    oneDNN's layout, which only oneDNN writes."""
    if kernel is torch.ops.thunder_batch.packed_linear.default:
        rows = w  # [O, I]: lane r of a block reads row r
        into = lambda blocks: blocks.transpose(1, 2)  # noqa: E731  [b, I, 16] -> [b, 16, I]
    elif kernel is torch.ops.thunder_batch.packed_linear_bf16.default:
        rows = w.reshape(w.shape[0], w.shape[1] // 2, 2)  # [O, I/2, 2]
        into = lambda blocks: blocks.permute(0, 2, 1, 3)  # noqa: E731  [b, I/2, 16, 2] -> [b, 16, I/2, 2]
    else:
        return False
    full, rest = divmod(w.shape[0], 16)
    into(packed[:full]).copy_(rows[: full * 16].reshape(full, 16, *rows.shape[1:]))
    if rest:
        into(packed[full : full + 1])[0, :rest].copy_(rows[full * 16 :])
    return True


def _onednn_linear(x, packed, bias, out_features: int):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def native_bf16(in_features: int) -> bool:
    """Whether the native bfloat16 kernel runs a linear of this input width (even) here: with `vdpbf16ps`
    (AVX512-BF16), or widening the weights to float32 (AVX2) where oneDNN has no bf16 linear either."""
    from thunder_batch.native.build import bf16_available, cpu_flags

    if in_features % 2 or not bf16_available():
        return False
    return "avx512_bf16" in cpu_flags() or not _onednn_runs_bf16()


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` from the packed copy of `w` (see the module docstring)."""
    packed, kernel = PACKED.get(w)
    return kernel(x, packed, bias, w.shape[0])


def native_quantized_linear(x, weight, bias, ggml_type: int, in_features: int, int8_activations: bool = False):
    """`quantized.quantized_linear` on the native kernel, reading the quantized blocks in place."""
    args = (x, weight, bias, ggml_type, in_features, int8_activations)
    return torch.ops.thunder_batch.quantized_linear.default(*args)


def decode_block(*args) -> torch.Tensor:
    """`model.decode_block` as the native op, from PACKED's copies of the linears (compile.block_op)."""
    return block_op.decode_block(PACKED, *args)


def native_linear(dtype: torch.dtype, weight_shape, rows: int) -> bool:
    """Whether a native kernel (not torch's, not oneDNN's) runs a CPU linear of this dtype, weight and rows."""
    native = dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16(weight_shape[1]))
    return native and claims_linear("cpu", [dtype], weight_shape, rows)


def claims_linear(device_type: str, dtypes: list, weight_shape, rows: int) -> bool:
    """Which linears the executor takes: CPU, one dtype throughout, a 2-D weight, and either at most
    `packed_rows(dtype)` rows for a native kernel (fp32; bf16 with AVX512-BF16, or widened on an AVX2-only
    CPU), bf16 at any rows on AMX, or bf16 at any rows on oneDNN's packed layout where the native bf16
    kernel does not run."""
    from thunder_batch.native import build

    if device_type != "cpu" or len(set(dtypes)) != 1 or len(weight_shape) != 2:
        return False
    if dtypes[0] == torch.bfloat16:
        if native_bf16(weight_shape[1]):
            return rows <= packed_rows(torch.bfloat16) or build.amx_runs(weight_shape[1])
        return onednn_bf16()
    return dtypes[0] == torch.float32 and rows <= packed_rows(torch.float32) and build.unavailable() is None


def packed_rows(dtype: torch.dtype) -> float:
    """The most rows a linear runs on the native kernel, per path (benchmarks/RESULTS.md): on AVX-512
    torch's GEMM is as fast above PACKED_ROWS[dtype]; on AVX2 torch's GEMM is slower at any rows, float32
    and bfloat16 alike ("AVX2: the native kernels on every x86-64 CPU", "Prompt steps on the native kernel")."""
    from thunder_batch.native.build import cpu_flags

    return PACKED_ROWS[dtype] if "avx512f" in cpu_flags() else math.inf


def linear_kernels() -> dict[str, str]:
    """Which kernel runs a decode step's CPU linears here, per precision (what `bench` reports)."""
    from thunder_batch.native import build

    if build.unavailable() is not None:
        return {"float32": "torch", "bfloat16": "oneDNN packed" if _onednn_runs_bf16() else "torch"}
    wide = "AVX-512" if "avx512f" in build.cpu_flags() else "AVX2"

    def rows(dtype: torch.dtype) -> str:
        limit = packed_rows(dtype)
        return f"up to {limit} rows, torch's GEMM above" if limit < math.inf else "any rows"

    if build.amx_runs(576):  # the default model's widths (576, 1536) are multiples of 32
        bf16 = "AMX tiles, any rows"
    elif not native_bf16(576):
        bf16 = "oneDNN packed, any rows"
    elif "avx512_bf16" in build.cpu_flags():
        bf16 = f"vdpbf16ps, {rows(torch.bfloat16)}"
    else:
        bf16 = "own layout, widened to float32 on AVX2, any rows"
    fp32 = "own layout, AVX2, any rows" if wide == "AVX2" else f"packed {wide}, {rows(torch.float32)}"
    return {"float32": fp32, "bfloat16": bf16}


def _onednn_runs_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_bf16() -> bool:
    """Whether oneDNN's bf16 linear runs on this CPU; where it does not, torch's bf16 linears run (a fallback)."""
    if _onednn_runs_bf16():
        return True
    why = "oneDNN's bf16 linear needs AVX512-BW/VL/DQ or AVX-NE-CONVERT"
    fallbacks.report("onednn_bf16", f"{why}: torch's bf16 linears run instead")
    return False


def _claims(x, w, bias=None) -> bool:
    """The executor's checker, on the proxies of a traced `linear`."""
    from thunder.core.dtypes import to_torch_dtype

    tensors = [t for t in (x, w, bias) if t is not None]
    if any(t.device.type != x.device.type for t in tensors):
        return False
    dtypes = [to_torch_dtype(t.dtype) for t in tensors]
    return claims_linear(x.device.type, dtypes, tuple(w.shape), math.prod(x.shape[:-1]))


def _claims_tensors(x, w, bias=None) -> bool:
    tensors = [t for t in (x, w, bias) if t is not None]
    if any(t.device != x.device for t in tensors):
        return False
    return claims_linear(x.device.type, [t.dtype for t in tensors], tuple(w.shape), math.prod(x.shape[:-1]))


class ProjectKernelsMode(TorchFunctionMode):
    """Eager code with the linears and attention this executor claims in traces run as it runs them:
    the load-time check of a stored piece compares against it, so both sides run the same kernels."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _claims_tensors(*args, **kwargs):
            return packed_linear(*args, **kwargs)
        if func is F.scaled_dot_product_attention and attention.claims_tensors(*args, **kwargs):
            return attention.decode_attention(*args, **kwargs)
        if func is quantized.quantized_linear:
            return native_quantized_linear(*args, **kwargs)
        if func is model.decode_block:  # only the blocks `block_op.takes` call it
            return decode_block(*args, **kwargs)
        return func(*args, **kwargs)


def _linear_meta(x, w, bias=None):
    from thunder.core.proxies import TensorProxy

    return TensorProxy(like=x, shape=(*x.shape[:-1], w.shape[0]))


def _quantized_meta(x, w, bias, ggml_type: int, in_features: int, int8_activations: bool = False):
    return _linear_meta(x, w, bias)
