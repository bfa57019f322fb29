"""What a traced piece depends on besides its tensors, read from the checks of Thunder's prologue.

Thunder bakes every non-tensor value it reads into a trace and re-checks it on each call: the
prologue unpacks module attributes (`unpack_submodule`, `unpack_attr`, `unpack_getitem`) and checks
them (`check_number_type_and_value`, `check_string_value`, ...), and checks every module tensor's
metadata. A `Check` is one of those: where the value lives, relative to the traced module, and the
value the trace was made for. Another module satisfies a trace's checks exactly when Thunder's own
prologue would accept it, so layers can share a trace without a hand-kept list of attributes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from thunder_batch.compile.cache import canonical_json
from thunder_batch.compile.trace_export import module_tensor

Path = tuple[tuple[str, object], ...]  # steps from the module: ("submodule", "block.attn"), ("attr", "eps"), ...
Check = tuple[Path, object]  # (where, the value the trace was made for)

_VALUE_CHECKS = {"check_number_type_and_value", "check_string_value", "check_literal_like", "check_none"}
_UNPACK_STEPS = {
    "unpack_submodule": "submodule",
    "unpack_attr": "attr",
    "unpack_getitem": "item",
    "unpack_parameter": "tensor",
    "unpack_buffer": "tensor",
}
_MISSING = object()


def prologue_checks(prologue_trace) -> list[Check]:
    """Every check the prologue makes on a value it reads from the module, in order."""
    paths: dict[str, Path] = {}
    checks: list[Check] = []
    for bsym in prologue_trace.bound_symbols:
        name, args = bsym.sym.name, bsym.args
        if name == "unpack_thunder_module":
            paths[bsym.output.name] = ()
        elif name in _UNPACK_STEPS and _name(args[0]) in paths:
            paths[bsym.output.name] = (*paths[_name(args[0])], (_UNPACK_STEPS[name], args[1]))
        elif name in _VALUE_CHECKS and _name(args[0]) in paths:
            checks.append((paths[_name(args[0])], plain(args[1]) if len(args) > 1 else None))
        elif name == "check_tensor_metadata" and _name(args[0]) in paths:
            checks.append((paths[_name(args[0])], tensor_checks(*args[1:5])))
    return checks


def _name(value) -> str | None:
    return getattr(value, "name", None)


def plain(value):
    """A checked literal as JSON-able data that compares equal exactly when the values do."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return [type(value).__name__, value]
    return [type(value).__name__, repr(value)]  # torch.dtype, torch.device and the like


def tensor_checks(shape, device, dtype, requires_grad) -> list:
    return ["tensor", list(shape), str(torch.device(device).type), str(dtype), bool(requires_grad)]


def value_at(module: nn.Module, path: Path):
    """The value `path` names on `module` (a tensor as its checked metadata); _MISSING if absent."""
    obj = module
    try:
        for kind, key in path:
            if kind == "submodule":
                obj = obj.get_submodule(key)
            elif kind == "attr":
                obj = getattr(obj, key)
            elif kind == "item":
                obj = obj[key]
            else:  # "tensor": a parameter or buffer by qualified name
                obj = module_tensor(obj, key)
                return tensor_checks(obj.shape, obj.device, obj.dtype, obj.requires_grad)
    except (AttributeError, KeyError, IndexError, TypeError):
        return _MISSING
    return plain(obj)


def mismatches(checks: Iterable[Check], module: nn.Module) -> set[Path]:
    """Paths whose value on `module` is not what the trace was made for."""
    return {path for path, value in checks if canonical_json(value_at(module, path)) != canonical_json(value)}


def differing_paths(a: Sequence[Check], b: Sequence[Check]) -> set[Path] | None:
    """Paths where two traces' checks disagree; None if they check different things."""
    if [path for path, _ in a] != [path for path, _ in b]:
        return None
    return {path for (path, x), (_, y) in zip(a, b) if canonical_json(x) != canonical_json(y)}


def digest(checks: Iterable[Check], ignored: Iterable[Path] = ()) -> str:
    """Stable hash of the checks, leaving out `ignored` paths (values that never change a trace)."""
    ignored = {canonical_json(p) for p in ignored}
    kept = [[path, value] for path, value in checks if canonical_json(path) not in ignored]
    return hashlib.sha256(canonical_json(kept).encode()).hexdigest()[:32]


def to_json(checks: Iterable[Check]) -> list:
    return json.loads(canonical_json([[path, value] for path, value in checks]))


def from_json(data: Iterable) -> list[Check]:
    return [(tuple(tuple(step) for step in path), value) for path, value in data]


def paths_to_json(paths: Iterable[Path]) -> list:
    return sorted(json.loads(canonical_json(list(paths))), key=canonical_json)


def paths_from_json(data: Iterable) -> set[Path]:
    return {tuple(tuple(step) for step in path) for path in data}
