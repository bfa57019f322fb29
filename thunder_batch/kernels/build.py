"""Build and load the native kernels once per machine (torch's C++ extension builder, g++ and ninja).

The build lands in torch's extension dir ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions),
keyed by the source, so a later process loads it in milliseconds. On a CPU without AVX-512, or a
machine without a compiler, `unavailable()` says why and callers keep torch's own kernels.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("packed_linear.cpp")
# -fopenmp: torch's own libgomp has the same soname, so the kernels share its OpenMP thread pool.
FLAGS = ["-O3", "-mavx512f", "-fopenmp"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run here, or None once they are built and loaded (once per process)."""
    if "avx512f" not in cpu_flags():
        return "this CPU has no AVX-512F"
    try:
        from torch.utils.cpp_extension import load

        load(
            name="thunder_batch_kernels",
            sources=[str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # no compiler, no ninja, a build error: torch's kernels stay
        print(f"thunder_batch: native kernels not built ({type(e).__name__}: {e})", file=sys.stderr)
        return f"build failed: {type(e).__name__}: {str(e)[:200]}"
    return None


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> [ceil(out / 16), in, 16], the layout `packed_linear` reads."""
    return torch.ops.thunder_batch.pack_linear_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    """float32 x [..., in] @ w.T (+ bias) from `pack_linear_weight(w)` -> [..., out_features]."""
    return torch.ops.thunder_batch.packed_linear(x, packed, bias, out_features)
