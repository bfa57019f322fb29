"""Build and load the native kernels (packed linears, decode attention, a decode block and a step's layers
of it as one loop) once per machine (torch's C++ extension builder, g++ and ninja).

The build lands in torch's extension dir ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions),
named by a hash of the source and flags, so a later process loads it in milliseconds. On a CPU
without AVX2 and FMA, or a machine without a compiler, `unavailable()` says why and callers keep torch's
own kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from thunder_batch import fallbacks

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "packed_linear.cpp",
        "packed_linear_bf16.cpp",
        "packed_linear_amx.cpp",
        "decode_attention.cpp",
        "decode_block.cpp",
        "decode_stack.cpp",
        "work_sharing.cpp",
        "quantized_linear.cpp",
        "plain_linear.cpp",
        "quantized_int8.cpp",
        "logit_controls.cpp",
    )
]
# Included by the sources: part of the build's name.
HEADERS = [
    Path(__file__).with_name(name)
    for name in ("ops.h", "packed_tiles.h", "quant_blocks.h", "quant_int8.h", "vector_avx2.h", "work_sharing.h")
]
# -fopenmp: torch's own libgomp has the same soname, so the kernels share its OpenMP thread pool.
# No -m flags: each kernel names its instruction set (AVX-512F, AVX512-BF16, AVX2 + FMA) and the fp32
# kernel picks its path from the CPU per call, so one build runs on every x86-64 CPU with AVX2.
FLAGS = ["-O3", "-fopenmp"]
# torch's builder waits, forever, while this file exists in the build dir; a build killed midway
# (Ctrl-C, a timeout) leaves it behind.
TORCH_BATON = "lock"


@functools.cache
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def build_name() -> str:
    """Named by content: processes running the same source (from any checkout) share one build."""
    files = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(files + repr(FLAGS).encode()).hexdigest()[:16]
    return f"thunder_batch_native_{digest}"


@contextlib.contextmanager
def locked_build_dir(build_dir: Path) -> Iterator[Path]:
    """Hold the build dir for this process alone; the OS releases the lock however the process ends.

    Holding it, no build of ours is running elsewhere, so torch's baton, if present, is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "thunder_batch.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / TORCH_BATON).unlink(missing_ok=True)
        yield build_dir


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run here, or None once they are built and loaded (once per process).
    Unavailable kernels are reported once (fallbacks: torch's linears and attention run instead)."""
    reason = _build_and_load()
    if reason is not None:
        why = f"native CPU kernels unavailable ({reason})"
        fallbacks.report("native_kernels", f"{why}: torch's linears and attention run instead")
    return reason


def copy_source(build_dir: Path, original: Path) -> Path:
    """A kernel source in the build dir, built from a copy (a checkout's edits never race a build); a
    copy that differs from it (cut short by a killed process) is replaced, atomically."""
    source = build_dir / original.name
    if not source.exists() or source.read_bytes() != original.read_bytes():
        partial = build_dir / f".{original.name}.{os.getpid()}.tmp"
        shutil.copyfile(original, partial)
        os.replace(partial, source)
    return source


def _build_and_load() -> str | None:
    if not {"avx2", "fma"} <= cpu_flags():
        return "this CPU has no AVX2 and FMA"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = build_name()
        with locked_build_dir(Path(_get_build_directory(name, verbose=False))) as build_dir:
            sources = [str(copy_source(build_dir, original)) for original in SOURCES]
            for header in HEADERS:
                copy_source(build_dir, header)
            load(
                name=name,
                sources=sources,
                build_directory=str(build_dir),
                extra_cflags=FLAGS,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as e:  # no compiler, no ninja, a build error: torch's kernels stay
        return f"build failed: {type(e).__name__}: {str(e)[:200]}"
    return None


def bf16_available() -> bool:
    """Whether the bfloat16 kernel runs here: wherever the kernels are built (AVX512-BF16's `vdpbf16ps`,
    else AVX2 + FMA on the weights widened to float32)."""
    return unavailable() is None


def amx_runs(in_features: int) -> bool:
    """Whether `packed_linear_bf16` runs on AMX here for this input width (AMX-BF16, the OS's leave, `in` a
    multiple of 32): then it takes every row count."""
    return unavailable() is None and torch.ops.thunder_batch.amx_runs(in_features)


def pack_linear_weight(w: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> [ceil(out / 16), in, 16], the layout `packed_linear` reads."""
    return torch.ops.thunder_batch.pack_linear_weight(w)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    """float32 x [..., in] @ w.T (+ bias) from `pack_linear_weight(w)` -> [..., out_features]."""
    return torch.ops.thunder_batch.packed_linear(x, packed, bias, out_features)


def pack_linear_weight_bf16(w: torch.Tensor) -> torch.Tensor:
    """bfloat16 [out, in] (in even) -> [ceil(out / 16), in / 2, 16, 2], the layout `packed_linear_bf16` reads."""
    return torch.ops.thunder_batch.pack_linear_weight_bf16(w)


def packed_linear_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    """bfloat16 x [..., in] @ w.T (+ bias) from `pack_linear_weight_bf16(w)` -> [..., out_features]: float32
    sums of exact products, rounded once."""
    return torch.ops.thunder_batch.packed_linear_bf16(x, packed, bias, out_features)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float):
    """softmax(q k^T * scale + mask) v: q [B, G, Q <= 16, D], k, v [B, G, L, D], mask [B, 1, 1, L] -> [B, G, Q, D]."""
    return torch.ops.thunder_batch.decode_attention(q, k, v, mask, scale)


def decode_rows_attention(q, k, v, cache_k, cache_v, rows, mask, scale: float) -> torch.Tensor:
    """A decode-only step's attention with its KV writes, one call: k, v [B, G, D] into the contiguous
    caches [B, G, S', D] at flat `rows` [B * G], then `decode_attention` of q [B, H, D] over the first L
    entries (mask [B, 1, 1, L]) -> [B, H * D]."""
    return torch.ops.thunder_batch.decode_rows_attention.default(q, k, v, cache_k, cache_v, rows, mask, scale)


def slot_rows_attention(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale: float) -> torch.Tensor:
    """A verify step's attention with its KV writes, one call: as `decode_rows_attention` for N rows, row n
    over slot `row_slot[n]`'s entries with its own mask row (mask [N, 1, 1, L]) -> [N, H * D]."""
    return torch.ops.thunder_batch.slot_rows_attention.default(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale)


def controlled_logits(logits, bias, counts, seen, allowed, knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.controlled_logits` in one pass (float32 logits, bias, counts [B, V], bool seen [B, V], int32 allowed
    bits [B, ceil(V / 32)], float32 knobs [B, 4]) -> (reported, steered) [B, V] each, equal to its torch ops'."""
    return torch.ops.thunder_batch.controlled_logits.default(logits, bias, counts, seen, allowed, knobs)
