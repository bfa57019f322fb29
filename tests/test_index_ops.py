"""index_copy_rows (the step's KV cache write) against a per-row loop, over random shapes, dims and dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from thunder_batch import index_copy_rows
from thunder_batch._compat import import_thunder
from thunder_batch.index_ops import index_copy_rows_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]


@st.composite
def copy_case(draw):
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


@settings(max_examples=150, deadline=None)
@given(copy_case())
def test_index_copy_rows_matches_loop(case):
    t, dim, slot, pos, val = case
    expected = index_copy_rows_reference(t.clone(), dim, slot, pos, val)
    out = t.clone()
    result = index_copy_rows(out, dim, slot, pos, val)
    assert result is out  # in place
    assert torch.equal(out, expected)


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


@pytest.mark.regression
@settings(max_examples=12, deadline=None)
@given(copy_case())
def test_traced_equals_eager_and_lowers_to_one_row_copy(case):
    thunder = import_thunder()
    t, dim, slot, pos, val = case
    expected = index_copy_rows_reference(t.clone(), dim, slot, pos, val)
    out = t.clone()
    jcopy = thunder.jit(lambda t, slot, pos, val: index_copy_rows(t, dim, slot, pos, val))
    jcopy(out, slot, pos, val)
    assert torch.equal(out, expected)
    ops = [bsym.sym.name for bsym in thunder.last_traces(jcopy)[-1].bound_symbols]
    # one row-wise copy for the whole step, not litgpt's loop of one index_copy_ per row
    assert ops.count("index_copy") + ops.count("index_copy_") == 1, ops
