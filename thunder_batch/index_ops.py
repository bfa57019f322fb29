"""The KV cache write of a step: every row of the step writes one cache entry of its own slot.

litgpt's `batched_index_copy_` loops over the batch in Python (docs/DESIGN.md, first paragraph); this
lowers to one row-wise `index_copy_`, traceable by Thunder, for any dim of any ndim.
"""

from __future__ import annotations

import math

import torch


def _normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a tensor with {ndim} dims")
    return dim % ndim


def index_copy_rows(
    t: torch.Tensor, dim: int, slot: torch.Tensor, pos: torch.Tensor, val: torch.Tensor
) -> torch.Tensor:
    """In place: `t[slot[n], ..., pos[n], ...] = val[n, ...]` along `dim` (>= 1) for every row n.

    t: [B, *pre, S, *post] contiguous, slot, pos: [N], val: [N, *pre, *post]. The (slot, pos) pairs
    must be distinct (as indices of `index_copy_`). Returns `t`.
    One `index_copy_` of whole rows into `t` seen as [B * P * S, *post] (P = prod(pre)): a row copy,
    where `scatter_` writes element by element (50x slower for bfloat16 on CPU, 10x for float32).
    """
    dim = _normalize_dim(dim, t.ndim)
    if dim == 0:
        raise ValueError("index_copy_rows indexes within a slot: dim must not be the slot dim 0")
    if not t.is_contiguous():
        raise ValueError("index_copy_rows writes through a flat view: t must be contiguous")
    (N,) = slot.shape
    B, S, P = t.shape[0], t.shape[dim], math.prod(t.shape[1:dim])
    post = t.shape[dim + 1 :]
    inner = torch.arange(P, device=slot.device).view(1, P)  # [1, P]
    rows = ((slot.view(N, 1) * P + inner) * S + pos.view(N, 1)).reshape(N * P)  # [N*P] rows of the flat view
    t.view(B * P * S, *post).index_copy_(0, rows, val.reshape(N * P, *post))
    return t


def index_copy_rows_reference(
    t: torch.Tensor, dim: int, slot: torch.Tensor, pos: torch.Tensor, val: torch.Tensor
) -> torch.Tensor:
    """Per-row loop: the oracle for `index_copy_rows` in tests."""
    dim = _normalize_dim(dim, t.ndim)
    for n in range(slot.shape[0]):
        t[int(slot[n])].select(dim - 1, int(pos[n])).copy_(val[n])
    return t
