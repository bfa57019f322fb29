"""The batched index ops against per-row loops and litgpt's own `batched_index_copy_` /
`batched_index_select`, over random shapes, dims and dtypes; both lowerings; and what Thunder makes of them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from litgpt.model import batched_index_copy_, batched_index_select

from thunder_batch._compat import import_thunder
from thunder_batch.index_ops import (
    flat_rows,
    index_copy_2d,
    index_copy_flat,
    index_copy_rows,
    index_select_2d,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]


def copy_rows_loop(t, dim, slot, pos, val):
    """The oracle: one entry per row, by Python indexing."""
    dim %= t.ndim
    for n in range(slot.shape[0]):
        t[int(slot[n])].select(dim - 1, int(pos[n])).copy_(val[n])
    return t


@st.composite
def rows_case(draw):
    ndim = draw(st.integers(2, 5))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dim = draw(st.sampled_from([d for d in range(-ndim, ndim) if d % ndim != 0]))
    shape[dim] = draw(st.integers(1, 6))
    B, S = shape[0], shape[dim]
    N = draw(st.integers(1, B * S))  # distinct (slot, pos) pairs, as index_copy_ requires
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    entries = torch.randperm(B * S, generator=g)[:N]
    slot, pos = entries // S, entries % S
    dtype = draw(st.sampled_from(DTYPES))
    t = (torch.randn(shape, generator=g) * 10).to(dtype)
    val_shape = [N, *(s for d, s in enumerate(shape) if d not in (0, dim % ndim))]
    val = (torch.randn(val_shape, generator=g) * 10).to(dtype)
    return t, dim, slot, pos, val


@st.composite
def batched_case(draw):
    """t [B, ..., S, ...], idx [B, T] distinct per row, val [B, ..., T, ...]; sometimes t non-contiguous."""
    ndim = draw(st.integers(2, 5))
    shape = draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(1, ndim - 1))
    shape[dim] = S = draw(st.integers(1, 6))
    T = draw(st.integers(1, S))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    idx = torch.stack([torch.randperm(S, generator=g)[:T] for _ in range(shape[0])])  # [B, T]
    dtype = draw(st.sampled_from(DTYPES))
    t = (torch.randn(shape, generator=g) * 10).to(dtype)
    if draw(st.booleans()) and ndim > 2:  # a transposed view: not contiguous unless a size is 1
        t = t.transpose(1, ndim - 1).contiguous().transpose(1, ndim - 1)
    val = (torch.randn([*shape[:dim], T, *shape[dim + 1 :]], generator=g) * 10).to(dtype)
    return t, dim, idx, val


@settings(max_examples=150, deadline=None)
@given(rows_case(), st.booleans())
def test_index_copy_rows_matches_loop_in_both_lowerings(case, scatter):
    t, dim, slot, pos, val = case
    expected = copy_rows_loop(t.clone(), dim, slot, pos, val)
    out = t.clone()
    if scatter:
        result = index_copy_flat(out, dim, flat_rows(out.shape, dim, slot, pos), val, scatter=True)
    else:
        result = index_copy_rows(out, dim, slot, pos, val)
    assert result is out  # in place
    assert torch.equal(out, expected)


@settings(max_examples=150, deadline=None)
@given(batched_case())
def test_index_copy_2d_matches_litgpt_and_a_loop(case):
    t, dim, idx, val = case
    litgpt_out = batched_index_copy_(t.clone(), dim, idx, val)  # litgpt's loop over the batch
    loop = t.clone()
    for b in range(t.shape[0]):
        loop[b].index_copy_(dim - 1, idx[b], val[b])
    out = t.clone()
    assert index_copy_2d(out, dim, idx, val) is out
    assert torch.equal(out, litgpt_out) and torch.equal(out, loop)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(0, 3), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**16))
def test_index_select_2d_matches_litgpt(ndim, dim, B, T, seed):
    dim = dim % ndim
    g = torch.Generator().manual_seed(seed)
    shape = torch.randint(1, 5, (ndim,), generator=g).tolist()
    t = torch.randn(shape, generator=g)
    idx = torch.randint(0, shape[dim], (B, T), generator=g)
    got = index_select_2d(t, dim, idx)
    assert torch.equal(got, batched_index_select(t, dim, idx))
    assert got.shape == (B, *shape[:dim], T, *shape[dim + 1 :])
    for b in range(B):  # row b is t gathered at idx[b]
        assert torch.equal(got[b], t.index_select(dim, idx[b]))


def test_one_dimensional_indices_are_plain_index_ops():
    t, idx = torch.arange(12.0).view(3, 4), torch.tensor([2, 0])
    assert torch.equal(index_select_2d(t, 1, idx), t.index_select(1, idx))
    out = index_copy_2d(t.clone(), 1, idx, torch.zeros(3, 2))
    assert torch.equal(out, t.clone().index_copy_(1, idx, torch.zeros(3, 2)))


def test_kv_cache_write_shape():
    cache = torch.zeros(2, 3, 16, 4)  # KV cache [B, G, S, D]
    slot, pos = torch.tensor([0, 1, 1, 1]), torch.tensor([5, 7, 8, 9])  # a decode row, a 3-token lane
    index_copy_rows(cache, 2, slot, pos, torch.ones(4, 3, 4))
    assert cache[0, :, 5].eq(1).all() and cache[1, :, 7:10].eq(1).all() and cache.sum() == 4 * 3 * 4


def test_copy_rejects_slot_dim():
    with pytest.raises(ValueError, match="slot dim"):
        index_copy_rows(
            torch.zeros(2, 3), 0, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.zeros(1)
        )
    with pytest.raises(ValueError, match="slot dim"):
        index_copy_2d(torch.zeros(2, 3), 0, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1))


def _traced_ops(fn, *args) -> list[str]:
    thunder = import_thunder()
    jfn = thunder.jit(fn)
    jfn(*args)
    return [bsym.sym.name for bsym in thunder.last_traces(jfn)[-1].bound_symbols]


@pytest.mark.regression
@settings(max_examples=12, deadline=None)
@given(rows_case())
def test_traced_equals_eager_and_lowers_to_one_row_copy(case):
    t, dim, slot, pos, val = case
    expected = copy_rows_loop(t.clone(), dim, slot, pos, val)
    out = t.clone()
    ops = _traced_ops(lambda t, slot, pos, val: index_copy_rows(t, dim, slot, pos, val), out, slot, pos, val)
    assert torch.equal(out, expected)
    # one row-wise copy for the whole step, not litgpt's loop of one index_copy_ per row
    assert ops.count("index_copy") + ops.count("index_copy_") == 1, ops


@pytest.mark.regression
def test_index_copy_2d_traces_to_one_write_in_either_lowering():
    t, idx, val = torch.zeros(3, 2, 8, 4), torch.tensor([[1, 2], [0, 7], [5, 6]]), torch.randn(3, 2, 2, 4)
    expected = batched_index_copy_(t.clone(), 2, idx, val)
    out = t.clone()
    ops = _traced_ops(lambda t, idx, val: index_copy_2d(t, 2, idx, val), out, idx, val)
    assert torch.equal(out, expected) and ops.count("index_copy") + ops.count("index_copy_") == 1, ops
    out = t.clone()
    rows = flat_rows(t.shape, 2, torch.tensor([0, 0, 1, 1, 2, 2]), idx.reshape(6))
    ops = _traced_ops(lambda t, rows, v: index_copy_flat(t, 2, rows, v, scatter=True), out, rows, val.movedim(2, 1))
    assert torch.equal(out, expected) and ops.count("scatter") + ops.count("scatter_") == 1, ops
