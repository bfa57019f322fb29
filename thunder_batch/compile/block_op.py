"""A decode-only step's llama-shaped block as one operator of the project's executor: `model.decode_block`
(RMSNorm, RoPE'd grouped attention with its K and V writes, a SiLU-gated MLP, no biases but qkv's, residual
adds in sequence) run by the native `decode_block`. Op by op a block was eleven host calls (five linears, the
attention op, five fused regions), each finding the host's caches cold after the weights streamed through.

The compile layer marks the blocks the op takes (`mark_blocks`: `BlockStep.one_call`): on CPU, with the native
kernels running each of the block's linears at the step's B rows and its attention, and with both the
project's executor and the Inductor fusion among the executors (the op stands for the regions the fusion
would make; without the fusion a compiled step runs eager's ops, bit for bit). Its pieces round where litgpt's
modules do; the load-time check's eager side runs the same op (`ProjectKernelsMode`). The project's executor
imports this module, so what it needs from the executor comes in as arguments.

Where every layer's program of a step shape is that one op, the layered program runs the layers from one native
loop (`BlockStack`): the same op calls in the same order, their arguments taken from one recorded step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from thunder_batch import model
from thunder_batch.compile.attention import DECODE_BLOCK, rows_op_runs


def register(executor, run: Callable) -> None:
    """The op on `executor`; `run`: an importable function calling `decode_block` with the executor's packed
    weights (a stored program names it)."""
    if DECODE_BLOCK not in executor.opmap:
        executor.register_operator(DECODE_BLOCK, meta=_meta, fn=run, replaces=model.decode_block)


def decode_block(packed_weights, x, norm_1, norm_2, qkv, qkv_bias, proj, fc_1, fc_2, mlp_proj, *rest) -> torch.Tensor:
    """`model.decode_block` as one native call, from the linears' packed copies. rest: cos, sin, cache_k,
    cache_v, rows, masks, kind, eps_1, eps_2, scale."""
    out_features = [qkv.shape[0], proj.shape[0], fc_1.shape[0], mlp_proj.shape[0]]
    qkv, proj, fc_1, fc_2, mlp_proj = (packed_weights.get(w)[0] for w in (qkv, proj, fc_1, fc_2, mlp_proj))
    return torch.ops.thunder_batch.decode_block.default(
        x, norm_1, norm_2, qkv, qkv_bias, proj, fc_1, fc_2, mlp_proj, out_features, *rest
    )


def mark_blocks(program, executors_on: bool, rows: int, native_linear: Callable) -> None:
    """Sets each block's `one_call`: whether its decode-only steps (`rows` rows) run as the one op here.
    executors_on: the project's executor and the fusion are both among the program's executors;
    native_linear(dtype, weight_shape, rows): whether a native kernel runs such a linear."""
    for block in program.blocks:
        block.one_call = executors_on and takes(block, rows, native_linear)


def takes(step_block, rows: int, native_linear: Callable) -> bool:
    """Whether the native op runs this BlockStep's decode-only steps of `rows` rows."""
    from litgpt.model import LLaMAMLP, RMSNorm

    block = step_block.block
    cfg = block.config
    if step_block.verify or step_block.experts is not None or step_block.rope_table is not None:
        return False
    if cfg.parallel_residual or cfg.norm_qk or cfg.rope_interleave or cfg.attention_logit_softcapping is not None:
        return False
    norms = (block.norm_1, block.norm_2)
    plain_norms = all(type(n) is RMSNorm and n.dim == -1 and not n.add_unit_offset for n in norms)
    if type(block.mlp) is not LLaMAMLP or not plain_norms:
        return False
    if not all(isinstance(m, nn.Identity) for m in (block.post_attention_norm, block.post_mlp_norm)):
        return False
    linears = (block.attn.qkv, block.attn.proj, block.mlp.fc_1, block.mlp.fc_2, block.mlp.proj)
    return (
        _linears_run(linears, norms, rows, native_linear)
        and cfg.rope_n_elem % 2 == 0
        and rows_op_runs(block.attn.qkv.weight.dtype, cfg.n_head, cfg.n_query_groups, cfg.head_size)
    )


def _linears_run(linears, norms, rows: int, native_linear: Callable) -> bool:
    """Plain nn.Linears (not quantized ones) with no biases but qkv's (the first), one float32 or bfloat16 dtype on
    CPU, each on a native kernel at `rows` rows."""
    if not all(type(m) is nn.Linear for m in linears):
        return False
    dtype = linears[0].weight.dtype
    tensors = [t for m in (*linears, *norms) for t in m.parameters()]
    if any(t.dtype != dtype or t.device.type != "cpu" for t in tensors) or any(m.bias is not None for m in linears[1:]):
        return False
    return dtype in (torch.float32, torch.bfloat16) and all(
        native_linear(dtype, tuple(m.weight.shape), rows) for m in linears
    )


def _meta(x, *args):
    from thunder.core.proxies import TensorProxy

    return TensorProxy(like=x)


# decode_block's arguments that every layer of a step shares and that change every step (the rest stay bound)
_STEP_ARGS = ("cos", "sin", "rows", "masks")
_PACKED_ARGS = ("qkv", "proj", "fc_1", "fc_2", "mlp_proj")  # the linears' packed copies


def _positions(names) -> list[int]:
    """Where the native decode_block takes these arguments (its schema's names)."""
    arguments = [a.name for a in torch.ops.thunder_batch.decode_block.default._schema.arguments]
    return [arguments.index(name) for name in names]


class OpCalls(TorchDispatchMode):
    """Records the native decode_block's calls made under it: (arguments, output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.thunder_batch.decode_block.default:
            self.calls.append((args, out))
        return out


class BlockStack:
    """The layers of a step shape as one native call (native `DecodeStack`), from a step's recorded op calls.
    Called with the layers' inputs (x, *shared) -> the last layer's output, or None once a weight behind a
    packed copy changed in place (the layers' programs then run, and pack it again)."""

    def __init__(self, native, shared_at: list[int]) -> None:
        self.native, self.shared_at = native, shared_at

    def __call__(self, x: torch.Tensor, shared: list) -> torch.Tensor | None:
        return torch.ops.thunder_batch.decode_stack.default(self.native, x, *(shared[i] for i in self.shared_at))

    @classmethod
    def of(cls, recorded: OpCalls, layers: int, x, shared: list, sources: dict) -> BlockStack | None:
        """From one step's calls (the blocks', inputs x, *shared), if each of the `layers` layers made exactly
        the one op, chained, on the same shared inputs; sources: id(packed copy) -> its weight."""
        calls, step_args = recorded.calls, _positions(_STEP_ARGS)
        if len(calls) != layers or not calls or not _chained(calls, x, step_args):
            return None
        first = calls[0][0]
        shared_at = [next((i for i, t in enumerate(shared) if t is first[j]), None) for j in step_args]
        watched = [sources.get(id(args[j])) for args, _ in calls for j in _positions(_PACKED_ARGS)]
        if None in shared_at or any(w is None for w in watched):
            return None
        native = torch.classes.thunder_batch.DecodeStack()
        bound = [i for i in range(1, len(first)) if i not in step_args]  # add_layer: all but x and the step's
        for args, _ in calls:
            native.add_layer(*(args[i] for i in bound))
        for weight in watched:
            native.watch(weight)
        return cls(native, shared_at)


def _chained(calls: list, x: torch.Tensor, step_args: list[int]) -> bool:
    """Whether each call takes the previous one's output (the first: x) and the first call's step arguments."""
    inputs = [x] + [out for _, out in calls[:-1]]
    first = calls[0][0]
    return all(
        args[0] is x_in and all(args[j] is first[j] for j in step_args)
        for (args, _), x_in in zip(calls, inputs, strict=True)
    )
