"""Batched index ops, traceable by Thunder: the KV cache write and the RoPE-table gather.

litgpt's `batched_index_copy_` loops over the batch in Python (docs/DESIGN.md, first paragraph); here
every write is one flat index op. `index_copy_2d` / `index_select_2d` have the semantics of litgpt's
`batched_index_copy_` / `batched_index_select`; the step's own KV write (`index_copy_rows`: rows of
any slot) and `index_copy_2d` (row b writes slot b) share one lowering, `index_copy_flat`:
- on CPU a row copy (`index_copy_` of whole rows of `t` seen as [B * P * S, *post]): `scatter_`
  writes element by element, many times slower, bfloat16 most (benchmarks/RESULTS.md, "Sizing a CPU
  box", the KV cache write);
- on CUDA a `scatter_` of the same rows, the form nvFuser claims (with `nv_enable_scatter`), so the
  write can sit inside a fusion.
"""

from __future__ import annotations

import math

import torch


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def _check_batched(t: torch.Tensor, dim: int) -> int:
    dim = _normalize_dim(dim, t.ndim)
    if dim == 0:
        raise ValueError("the batched index ops index within a slot: dim must not be the slot dim 0")
    return dim


def flat_rows(shape: torch.Size, dim: int, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rows that entries `[slot[n], ..., pos[n], ...]` along `dim` (>= 1) occupy in a contiguous tensor
    of `shape` [B, *pre, S, *post] seen as [B * P * S, *post] (P = prod(pre)): [N * P], n-major.
    slot, pos: [N]. Depends only on the shape: a step computes it once for every layer's cache."""
    dim = _normalize_dim(dim, len(shape))
    (N,) = slot.shape
    S, P = shape[dim], math.prod(shape[1:dim])
    inner = torch.arange(P, device=slot.device).view(1, P)  # [1, P]
    return ((slot.view(N, 1) * P + inner) * S + pos.view(N, 1)).reshape(N * P)  # [N * P]


def index_copy_flat(
    t: torch.Tensor, dim: int, rows: torch.Tensor, val: torch.Tensor, scatter: bool | None = None
) -> torch.Tensor:
    """In place: row `rows[i]` of contiguous `t` seen as [B * P * S, *post] takes `val` seen as
    [N * P, *post] (rows from `flat_rows`, distinct). val: [N, *pre, *post]. Returns `t`.
    scatter: the lowering (None: `scatter_` on CUDA, a row copy elsewhere); both write the same."""
    post = t.shape[_normalize_dim(dim, t.ndim) + 1 :]
    flat_t = t.view(t.numel() // math.prod(post), *post)  # [B * P * S, *post]
    flat_val = val.reshape(rows.shape[0], *post)  # [N * P, *post]
    if t.device.type == "cuda" if scatter is None else scatter:  # nvFuser fuses scatter, not index_copy
        index = rows.view(-1, *([1] * len(post))).expand(flat_val.shape)
        flat_t.scatter_(0, index, flat_val)
    else:
        flat_t.index_copy_(0, rows, flat_val)
    return t


def index_copy_rows(
    t: torch.Tensor, dim: int, slot: torch.Tensor, pos: torch.Tensor, val: torch.Tensor
) -> torch.Tensor:
    """In place: `t[slot[n], ..., pos[n], ...] = val[n, ...]` along `dim` (>= 1) for every row n.

    t: [B, *pre, S, *post] contiguous, slot, pos: [N], val: [N, *pre, *post]. The (slot, pos) pairs
    must be distinct (as indices of `index_copy_`). Returns `t`. One flat write (`index_copy_flat`).
    """
    dim = _check_batched(t, dim)
    if not t.is_contiguous():
        raise ValueError("index_copy_rows writes through a flat view: t must be contiguous")
    return index_copy_flat(t, dim, flat_rows(t.shape, dim, slot, pos), val)


def index_copy_2d(t: torch.Tensor, dim: int, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """In place, for every b: `t[b].index_copy_(dim - 1, idx[b], val[b])`; returns `t` (litgpt's
    `batched_index_copy_`). t: [B, *pre, S, *post], idx: [B, T], val: [B, *pre, T, *post]; dim >= 1.
    A 1-D idx is a plain `index_copy_` along `dim`. Contiguous `t`: one flat write, slot b's rows;
    otherwise one `scatter_` along `dim`."""
    if idx.ndim == 1:
        return t.index_copy_(dim, idx, val)
    dim = _check_batched(t, dim)
    B, T = idx.shape
    if not t.is_contiguous():
        shape = [B] + [1] * (val.ndim - 1)
        shape[dim] = T
        return t.scatter_(dim, idx.view(shape).expand(val.shape), val)
    slot = torch.arange(B, device=idx.device).view(B, 1).expand(B, T).reshape(B * T)  # [B * T]
    rows_val = val.movedim(dim, 1)  # [B, T, *pre, *post]: entry-major, as index_copy_rows takes it
    return index_copy_rows(t, dim, slot, idx.reshape(B * T), rows_val.reshape(B * T, *rows_val.shape[2:]))


def index_select_2d(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """Gather from an unbatched `t` with a batched index (litgpt's `batched_index_select`): one flat
    `index_select`, the batch dim of idx moved to the front. t: [*pre, S, *post], idx: [B, T] ->
    [B, *pre, T, *post]. A 1-D idx is a plain `index_select`."""
    if idx.ndim == 1:
        return t.index_select(dim, idx)
    dim = _normalize_dim(dim, t.ndim)
    B, T = idx.shape
    gathered = t.index_select(dim, idx.reshape(B * T))  # [*pre, B * T, *post]
    gathered = gathered.view(*t.shape[:dim], B, T, *t.shape[dim + 1 :])  # [*pre, B, T, *post]
    return gathered.movedim(dim, 0)  # [B, *pre, T, *post]
