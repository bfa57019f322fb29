"""Slower or degraded paths taken instead of the fast one, reported instead of silent.

Each kind is warned about once per process (a `FallbackWarning` saying what runs instead and why)
and counted every time it is taken; `Engine.stats()["fallbacks"]` shows the counts. Kinds:
- `unfused_region`: a fusion region could not be compiled (no compiler, unwritable or full disk):
  it runs as its torch ops.
- `region_strides`: a compiled region was called with other strides than it was compiled for: that
  call ran its torch ops.
- `region_unsaved`: a compiled region could not be stored (it runs, and is compiled again next time).
- `native_kernels`: the native CPU kernels could not be built: torch's linears run instead.
- `moe_layout`: torch's grouped matmul does not run a mixture-of-experts layer here: the gathered or
  dense layout runs instead (more FLOPs).
- `cuda_graph_capture`: a step shape could not be captured in a CUDA graph: it runs uncaptured.
- `native_loop`: a step shape's layers as one native loop failed its check against the layers'
  programs on its first step: the programs run, a call each.
"""

from __future__ import annotations

import warnings
from collections import Counter

_counts: Counter = Counter()  # kind -> times taken in this process
_warned: set[str] = set()


class FallbackWarning(UserWarning):
    """A slower or degraded path is taken (see thunder_batch.fallbacks)."""


def report(kind: str, message: str) -> None:
    """Count one use of fallback `kind`; the first of the process also warns with `message`."""
    _counts[kind] += 1
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"{message} (reported once; counted in stats()['fallbacks'])", FallbackWarning, stacklevel=3)


def counts() -> dict[str, int]:
    """kind -> times taken in this process."""
    return dict(_counts)
