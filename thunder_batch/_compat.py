"""torch / Thunder compatibility, applied before `thunder` is imported.

torch 2.13 removed the named-tensor methods that Thunder 0.2.7's op table still lists
(`Tensor.align_as`, ...). Thunder only needs the attributes to exist and to carry their own
`__name__`; calling one raises, as named tensors are gone. Methods torch still has are left alone.
"""

from __future__ import annotations

import torch

REMOVED_NAMED_TENSOR_METHODS = ("align_as", "align_to", "has_names", "refine_names", "rename", "rename_")


def _removed_method(name: str):
    def method(self, *args, **kwargs):
        raise RuntimeError(f"torch.Tensor.{name} was removed from torch (named tensors are gone)")

    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    return method


def patch_torch_for_thunder() -> list[str]:
    """Add stand-ins for the named-tensor methods this torch lacks; returns the names added."""
    added = []
    for name in REMOVED_NAMED_TENSOR_METHODS:
        if not hasattr(torch.Tensor, name):
            setattr(torch.Tensor, name, _removed_method(name))
            added.append(name)
    return added


def import_thunder():
    """Import thunder with the compatibility patches applied; the one entry point to thunder."""
    patch_torch_for_thunder()
    import thunder

    return thunder
