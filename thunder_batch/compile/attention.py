"""Decode attention claimed by the project's executor: `scaled_dot_product_attention` of a decode step's
few query rows per K/V group (q [B, G, Q <= 16, D], an additive mask [B, 1, 1, L]) runs on the native
kernel (thunder_batch.native: every slot's keys and values read once for all of its group's query
rows; torch's CPU flash kernel costs more at these shapes: benchmarks/RESULTS.md, "AVX2: the native
kernels on every x86-64 CPU", its decode attention). Prefill lanes (many query rows, a mask per row) stay
with torch's.

A decode-only step's whole attention, KV writes included (`model.decode_rows_attention`), is one operator
of the executor: the native `decode_rows_attention` where this kernel runs, the model's own ops elsewhere;
so is a verify step's (`model.slot_rows_attention`: each row over its own slot's cache and mask row).
Traced op by op it was ~25 host calls per layer (writes, views, attention), each paying caches the
linears' weight stream left cold. Its cache writes are hidden from Thunder's functional trace:
`WRITES_IN_PLACE` names them for the passes that look for in-place writes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from thunder_batch.native import build

ATTENTION = "thunder_batch_decode_attention"
ROWS_ATTENTION = "thunder_batch_decode_rows_attention"
SLOT_ROWS_ATTENTION = "thunder_batch_slot_rows_attention"
DECODE_BLOCK = "thunder_batch_decode_block"  # a decode-only step's whole block (compile.block_op)
# operator -> the arguments it writes in place (the caches)
WRITES_IN_PLACE = {ROWS_ATTENTION: (3, 4), SLOT_ROWS_ATTENTION: (3, 4), DECODE_BLOCK: (11, 12)}
MAX_QUERIES = 16  # query rows per (slot, group): the kernel keeps them in registers and on its stack
MAX_HEAD_SIZE = 256


def register(executor) -> None:
    """`decode_attention` as an implementation of Thunder's sdpa, for the calls `_claims` accepts."""
    import thunder.torch as ltorch

    if ATTENTION not in executor.opmap:
        op = executor.register_operator(ATTENTION, meta=_meta, fn=decode_attention)
        executor.register_implementation(ltorch.scaled_dot_product_attention, op, checker=_claims)
    if ROWS_ATTENTION not in executor.opmap:
        from thunder_batch import model

        executor.register_operator(
            ROWS_ATTENTION, meta=_rows_meta, fn=decode_rows_attention, replaces=model.decode_rows_attention
        )
    if SLOT_ROWS_ATTENTION not in executor.opmap:
        from thunder_batch import model

        executor.register_operator(
            SLOT_ROWS_ATTENTION, meta=_slot_rows_meta, fn=slot_rows_attention, replaces=model.slot_rows_attention
        )


def claims_attention(device_type: str, dtypes: list, q_shape, k_shape, mask_shape, dropout_p, is_causal) -> bool:
    """CPU, one float32 or bfloat16 dtype for q, k, v and an additive mask [B, 1, 1, L]; q [B, G, Q, D]
    with Q <= MAX_QUERIES over k, v [B, G, L, D]; no dropout, no causal flag; the kernels built here."""
    if device_type != "cpu" or len(set(dtypes)) != 1 or dtypes[0] not in (torch.float32, torch.bfloat16):
        return False
    if dropout_p or is_causal or mask_shape is None or len(q_shape) != 4 or len(k_shape) != 4:
        return False
    B, G, Q, D = q_shape
    if tuple(k_shape) != (B, G, k_shape[2], D) or tuple(mask_shape) != (B, 1, 1, k_shape[2]):
        return False
    from thunder_batch.native.build import unavailable

    return Q <= MAX_QUERIES and D <= MAX_HEAD_SIZE and unavailable() is None


def claims_tensors(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> bool:
    """The same question on real tensors (eager code run as the executor runs it)."""
    return _claims_call(q, k, v, attn_mask, dropout_p, is_causal, dtype_of=lambda t: t.dtype)


def decode_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> torch.Tensor:
    """F.scaled_dot_product_attention for a claimed call -> [B, G, Q, D]. Strides are known only now
    (a trace has none): rows of k, v and the mask must be contiguous, else torch's kernel runs."""
    if k.stride(-1) != 1 or v.stride() != k.stride() or attn_mask.stride(-1) != 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return build.decode_attention(q.contiguous(), k, v, attn_mask, scale)


def decode_rows_attention(q, k, v, cache_k, cache_v, rows, mask, scale: float) -> torch.Tensor:
    """`model.decode_rows_attention` (q [B, H, D], caches [B, G, S', D]) as one native op where the kernel
    takes it, else as the model writes it."""
    if _native_takes(q, k, v, cache_k, cache_v, mask):
        return build.decode_rows_attention(q.contiguous(), k, v, cache_k, cache_v, rows, mask, scale)
    from thunder_batch import model

    return model.decode_rows_attention(q, k, v, cache_k, cache_v, rows, mask, scale)


def slot_rows_attention(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale: float) -> torch.Tensor:
    """`model.slot_rows_attention` (a verify step's: each row over its own slot's cache) as one native op
    where the kernel takes it (reading the caches in place), else as the model writes it."""
    if _native_takes(q, k, v, cache_k, cache_v, mask):
        return build.slot_rows_attention(q.contiguous(), k, v, cache_k, cache_v, rows, row_slot, mask, scale)
    from thunder_batch import model

    return model.slot_rows_attention(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale)


def _native_takes(q, k, v, cache_k, cache_v, mask) -> bool:
    """Whether a rows-attention call (q [N, H, D], caches [B, G, S', D]) runs on the native op."""
    H, D, G = q.shape[1], q.shape[2], cache_k.shape[1]
    key = (q.device.type, q.dtype, cache_k.dtype, mask.dtype, H, G, D, k.stride(-1), v.stride(-1), mask.stride(-1))
    return _native_rows(*key) and cache_k.is_contiguous() and cache_v.is_contiguous()


def rows_op_runs(dtype: torch.dtype, H: int, G: int, D: int) -> bool:
    """Whether the native rows attention takes a CPU model of these heads in `dtype` (contiguous rows)."""
    return _native_rows("cpu", dtype, dtype, dtype, H, G, D, 1, 1, 1)


@functools.cache
def _native_rows(device_type, q_dtype, cache_dtype, mask_dtype, H, G, D, k_step, v_step, mask_step) -> bool:
    """Whether the native op takes a call of this kind (rows of k, v and the mask contiguous, as `claims_attention`)."""
    if H % G or k_step != 1 or v_step != 1 or mask_step != 1:
        return False
    q_shape, k_shape = (1, G, H // G, D), (1, G, 1, D)
    return claims_attention(device_type, [q_dtype, cache_dtype, mask_dtype], q_shape, k_shape, (1, 1, 1, 1), 0.0, False)


def _claims(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> bool:
    """The executor's checker, on the proxies of a traced sdpa."""
    from thunder.core.dtypes import to_torch_dtype

    return _claims_call(q, k, v, attn_mask, dropout_p, is_causal, dtype_of=lambda t: to_torch_dtype(t.dtype))


def _claims_call(q, k, v, attn_mask, dropout_p, is_causal, dtype_of) -> bool:
    """`claims_attention` for one call's tensors or proxies (`dtype_of`: a torch dtype of either)."""
    tensors = [q, k, v] + ([attn_mask] if attn_mask is not None else [])
    if tuple(v.shape) != tuple(k.shape) or any(t.device.type != q.device.type for t in tensors):
        return False
    mask_shape = None if attn_mask is None else tuple(attn_mask.shape)
    dtypes = [dtype_of(t) for t in tensors]
    return claims_attention(q.device.type, dtypes, tuple(q.shape), tuple(k.shape), mask_shape, dropout_p, is_causal)


def _rows_meta(q, k, v, cache_k, cache_v, rows, mask, scale):
    from thunder.core.proxies import TensorProxy

    return TensorProxy(like=q, shape=(q.shape[0], q.shape[1] * q.shape[2]))


def _slot_rows_meta(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale):
    return _rows_meta(q, k, v, cache_k, cache_v, rows, mask, scale)


def _meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    from thunder.core.proxies import TensorProxy

    return TensorProxy(like=q, shape=(*q.shape[:-1], v.shape[-1]))
