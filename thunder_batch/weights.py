"""Which of a model's weights changed since the engine last looked, and copying new values into them.

The engine reads the caller's model in place. A weight can change in three ways, seen three ways here:
- in place (`p.mul_()`, `p.copy_()`, `load_state_dict(sd)`): its version counter moves;
- its data replaced (`p.data = t`: `model.to()`, many fine-tuning tools): the same tensor object,
  another address;
- a new tensor (`load_state_dict(sd, assign=True)`, `module.weight = nn.Parameter(t)`): another object.
Writes through `.data` into the same memory (`p.data.copy_(t)`) move none of these: the caller says so
(`Engine.refresh_weights`). A changed shape, dtype or device is refused (`WeightsChangedError`): the
step program and the KV caches were made for the old ones. So is a replaced submodule: the step
program holds the model's modules themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.modules import module as nn_module

_module_assignments = [0]  # submodules assigned anywhere in this process (a replaced layer is one)


def _count_assignment(module, name, submodule):
    _module_assignments[0] += 1


nn_module.register_module_module_registration_hook(_count_assignment)


class WeightsChangedError(ValueError):
    """A weight of the model changed in a way the running engine cannot follow."""


@dataclass
class WeightChanges:
    """What changed since the last look: `edited` any weight at all (kept prefixes are then stale);
    `moved` the parameters now read from other memory (a new tensor, or new data under the same one)."""

    edited: bool = False
    moved: list[torch.Tensor] = field(default_factory=list)


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


class WeightWatch:
    """The parameters of `model` as the engine last saw them: per qualified name (a tied weight under
    each of its names) the tensor object, its address, version counter, shape, dtype and device. A look
    costs a few attribute reads per parameter (~0.3 us each): it runs before every step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules(remove_duplicate=False))
        self._assignments = _module_assignments[0]
        # (qualified name, the dict holding it, its key): the module's own slot, so a new tensor is seen
        self._slots = [
            (f"{prefix}.{key}" if prefix else key, m._parameters, key)
            for prefix, m in self._modules.items()
            for key, t in m._parameters.items()
            if t is not None
        ]
        tensors = self._now()
        self._remember(tensors, self._look(tensors))
        self._metas = [_meta(t) for t in self._tensors]

    def _remember(self, tensors: list[torch.Tensor], seen: list[tuple[int, int, int]]) -> None:
        # Held, so that no other tensor takes their ids and no new data their memory (`half()` then `float()`
        # between two looks would give back the first memory: no address would seem to change).
        self._tensors, self._memory, self._seen = tensors, [t.detach() for t in tensors], seen

    def _now(self) -> list[torch.Tensor]:
        return [params[key] for _, params, key in self._slots]

    @staticmethod
    def _look(tensors: list[torch.Tensor]) -> list[tuple[int, int, int]]:
        return [(id(t), t.data_ptr(), t._version) for t in tensors]

    def changes(self) -> WeightChanges:
        """What changed since the last call (raises WeightsChangedError, remembering nothing, on a change the
        engine cannot follow); the caller follows `moved` before the next step."""
        self._check_modules()
        tensors = self._now()
        try:
            now = self._look(tensors)
        except AttributeError:  # `module.weight = None`: nothing to run in its place
            name = next(name for (name, *_), t in zip(self._slots, tensors) if t is None)
            message = f"weight {name} was removed (it is None): put it back, or build a new Engine"
            raise WeightsChangedError(message) from None
        if now == self._seen:
            return WeightChanges()
        moved: list[torch.Tensor] = []
        for (name, *_), t, (key, ptr, _), (old_key, old_ptr, _), meta in zip(
            self._slots, tensors, now, self._seen, self._metas
        ):
            if key == old_key and ptr == old_ptr:
                continue
            if _meta(t) != meta:
                raise WeightsChangedError(
                    f"weight {name} changed from {_describe(meta)} to {_describe(_meta(t))}: a running engine keeps "
                    "the shapes, dtype and device it was built for; restore them, or build a new Engine for the new "
                    "model (copy new values in with Engine.update_weights)"
                )
            if not any(t is m for m in moved):  # a tied weight: once
                moved.append(t)
        self._remember(tensors, now)
        return WeightChanges(edited=True, moved=moved)

    def _check_modules(self) -> None:
        """A submodule assigned anywhere since the last look: is it one of the model's?"""
        if _module_assignments[0] == self._assignments:
            return
        now = dict(self.model.named_modules(remove_duplicate=False))
        replaced = [name for name, m in now.items() if self._modules.get(name) is not m]
        if replaced or now.keys() != self._modules.keys():
            name = (replaced or sorted(now.keys() ^ self._modules.keys()))[0]
            raise WeightsChangedError(
                f"submodule {name or 'the model'!r} of the model was replaced or removed: the engine's step program "
                "holds the model's own modules; put the old one back and copy new weights into it "
                "(Engine.update_weights), or build a new Engine"
            )
        self._assignments = _module_assignments[0]

    def every_parameter(self) -> list[torch.Tensor]:
        return list(self._tensors)


def _describe(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"{list(shape)} {str(dtype).removeprefix('torch.')} on {device}"


@torch.no_grad()
def copy_weights(model: nn.Module, weights: Mapping | Iterable) -> list[torch.Tensor]:
    """Copy `weights` ({name: tensor}, or (name, tensor) pairs; names as in `model.state_dict()`) into the
    model's own tensors, in place; returns the tensors written. Every name and shape is checked before
    anything is written: a bad one raises ValueError naming it and changes nothing."""
    pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
    live = dict(model.state_dict(keep_vars=True))
    targets = []
    for name, value in pairs:
        if name not in live:
            raise ValueError(f"update_weights: the model has no weight named {name!r}")
        if not isinstance(value, torch.Tensor) or value.shape != live[name].shape:
            got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"update_weights: {name} is {list(live[name].shape)}, got {got}")
        targets.append(live[name])
    for target, (_, value) in zip(targets, pairs):
        target.copy_(value)
    return targets
