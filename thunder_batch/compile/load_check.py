"""The load-time check of a stored piece: it runs beside the eager module on the same inputs, from the
same buffer contents, and must agree with it (outputs and in-place cache writes) before it is used."""

from __future__ import annotations

import contextlib

import torch

from thunder_batch.compile.fused_region import regions_as_torch_ops

LOAD_RTOL, LOAD_ATOL = 1e-4, 1e-5


def checked_call(bound, module, args: tuple, eager_linears=contextlib.nullcontext) -> str | None:
    """What disagrees between a stored piece bound to `module` and the eager module run on the same
    inputs from the same buffer contents (random: the KV caches' entries that real rows read), or None.
    Outputs and in-place writes must agree; the buffers are left as they were. `eager_linears`: a context
    the eager module runs in (the kernels the program's executors claim, so both sides compute the same
    way). The piece's fusion regions run as their torch ops (each compiled region is checked on its own)."""
    saved = [b.clone() for b in bound.writes]
    try:
        _fill_randomly(bound.writes)
        with eager_linears():
            want = module(*args)
        eager_writes = [b.clone() for b in bound.writes]
        _fill_randomly(bound.writes)
        with regions_as_torch_ops():
            got = bound(*args)
        return _disagreement(bound, got, want, eager_writes)
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    finally:
        for buffer, before in zip(bound.writes, saved):
            buffer.copy_(before)


def _fill_randomly(buffers: list[torch.Tensor]) -> None:
    """The same pseudo-random contents on every call (both sides of a check start alike)."""
    generator = torch.Generator().manual_seed(0)
    for buffer in buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=torch.float32))


def _disagreement(bound, got, want, eager_writes: list) -> str | None:
    if not all(_close(b, e) for b, e in zip(bound.writes, eager_writes)):
        return "KV cache writes differ from eager (not written in place?)"
    got_t, want_t = _flat(got), _flat(want)
    if len(got_t) != len(want_t) or not all(_close(g, w) for g, w in zip(got_t, want_t)):
        return "outputs differ from eager"
    return None


def _flat(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.is_floating_point:
        return torch.allclose(got, want, rtol=LOAD_RTOL, atol=LOAD_ATOL)
    return torch.equal(got, want)
