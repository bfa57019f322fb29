"""Index ops with a batched index `idx[B, T]`, traceable by Thunder, any dim of any ndim.

litgpt's `batched_index_copy_` loops over the batch in Python (docs/DESIGN.md, first paragraph); these
lower to one `index_select` (a gather: nvFuser's `take`) and one row-wise `index_copy_` instead.
"""

from __future__ import annotations

import math

import torch


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def index_select_2d(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """Gather from an unbatched table `t` along `dim` with a batched index.

    t: [*pre, S, *post] (S at `dim`), idx: [B, T] -> [B, *pre, T, *post]
    e.g. rope cos [S, D] at dim 0 -> [B, T, D]; a mask [1, 1, S, S] at dim 2 -> [B, 1, 1, T, S].
    """
    dim = _normalize_dim(dim, t.ndim)
    B, T = idx.shape
    flat = torch.index_select(t, dim, idx.reshape(-1))  # [*pre, B*T, *post]
    split = flat.reshape(*t.shape[:dim], B, T, *t.shape[dim + 1 :])  # [*pre, B, T, *post]
    return split.movedim(dim, 0)  # [B, *pre, T, *post]


def index_copy_2d(t: torch.Tensor, dim: int, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """In place: `t[b, ..., idx[b, i], ...] = val[b, ..., i, ...]` along `dim` (>= 1) for every b.

    t: [B, *pre, S, *post] contiguous, idx: [B, T], val: [B, *pre, T, *post]. Indices within a row
    must be distinct (as for `index_copy_`). Returns `t`.
    One `index_copy_` of whole rows into `t` seen as [B * P * S, *post] (P = prod(pre)): a row copy,
    where `scatter_` writes element by element (50x slower for bfloat16 on CPU, 10x for float32).
    """
    dim = _normalize_dim(dim, t.ndim)
    if dim == 0:
        raise ValueError("index_copy_2d indexes per batch row: dim must not be the batch dim 0")
    if not t.is_contiguous():
        raise ValueError("index_copy_2d writes through a flat view: t must be contiguous")
    B, T = idx.shape
    S, P = t.shape[dim], math.prod(t.shape[1:dim])
    post = t.shape[dim + 1 :]
    row_base = torch.arange(B * P, device=idx.device).view(B, P, 1) * S  # [B, P, 1]: first row of (b, p)
    rows = (row_base + idx.view(B, 1, T)).reshape(B * P * T)  # [B*P*T]
    t.view(B * P * S, *post).index_copy_(0, rows, val.reshape(B * P * T, *post))
    return t


def index_select_2d_reference(t: torch.Tensor, dim: int, idx: torch.Tensor) -> torch.Tensor:
    """Per-row loop: the oracle for `index_select_2d` in tests."""
    return torch.stack([torch.index_select(t, dim, row) for row in idx])


def index_copy_2d_reference(t: torch.Tensor, dim: int, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """Per-row loop: the oracle for `index_copy_2d` in tests (litgpt's fallback)."""
    dim = _normalize_dim(dim, t.ndim)
    for b in range(idx.shape[0]):
        t[b].index_copy_(dim - 1, idx[b], val[b])
    return t
