"""The controlled heads' logit controls as one op of the project's executor: `sampler.controlled_logits` (a
grammar's mask, logit_bias, the penalties) runs as the native one-pass kernel on CPU float32 rows, else as its
torch ops (CUDA, or no native build). The kernel computes each element as those ops do, so compiled steps sample
what eager ones do. It took a constrained decode step from 0.83x a free one's speed to 0.92-0.98x (RESULTS.md,
"Structured output's cost after the native controls")."""

from __future__ import annotations

import torch

from thunder_batch import sampler
from thunder_batch.native import build

CONTROLLED_LOGITS = "thunder_batch_controlled_logits"


def register(executor) -> None:
    if CONTROLLED_LOGITS not in executor.opmap:
        executor.register_operator(
            CONTROLLED_LOGITS, meta=_meta, fn=controlled_logits, replaces=sampler.controlled_logits
        )


def controlled_logits(logits, bias, counts, seen, allowed, knobs) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampler.controlled_logits`, natively where the kernel takes the call."""
    tensors = (logits, bias, counts, seen, allowed, knobs)
    if all(t.device.type == "cpu" for t in tensors) and logits.dtype == torch.float32 and build.unavailable() is None:
        return build.controlled_logits(*tensors)
    return sampler.controlled_logits(*tensors)


def _meta(logits, bias, counts, seen, allowed, knobs):
    from thunder.core.proxies import TensorProxy

    return TensorProxy(like=logits), TensorProxy(like=logits)
