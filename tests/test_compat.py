"""The torch 2.13 / Thunder compatibility layer."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from thunder_batch._compat import REMOVED_NAMED_TENSOR_METHODS, patch_torch_for_thunder


def test_stand_ins_carry_their_own_names_and_raise_when_called():
    patch_torch_for_thunder()
    for name in REMOVED_NAMED_TENSOR_METHODS:
        method = getattr(torch.Tensor, name)
        assert method.__name__ == name  # Thunder checks this
        if method.__module__ == "thunder_batch._compat":  # ours, not a torch that still has it
            with pytest.raises(RuntimeError, match="removed"):
                method(torch.zeros(1))


def test_patch_is_idempotent_and_leaves_existing_methods_alone():
    patch_torch_for_thunder()
    before = {n: getattr(torch.Tensor, n) for n in REMOVED_NAMED_TENSOR_METHODS}
    assert patch_torch_for_thunder() == []
    assert all(getattr(torch.Tensor, n) is before[n] for n in REMOVED_NAMED_TENSOR_METHODS)


def test_plain_import_thunder_needs_the_patch_and_import_thunder_works():
    """Guards the reason this module exists: if Thunder stops needing it, the first check flips."""
    code = "import torch; print(all(hasattr(torch.Tensor, n) for n in {names!r}))"
    has_all = (
        subprocess.run(
            [sys.executable, "-c", code.format(names=REMOVED_NAMED_TENSOR_METHODS)], capture_output=True, text=True
        ).stdout.strip()
        == "True"
    )
    plain = subprocess.run([sys.executable, "-c", "import thunder"], capture_output=True, text=True)
    assert (plain.returncode == 0) == has_all, plain.stderr[-500:]
    ours = subprocess.run(
        [sys.executable, "-c", "from thunder_batch._compat import import_thunder; print(import_thunder().__version__)"],
        capture_output=True,
        text=True,
    )
    assert ours.returncode == 0 and ours.stdout.strip(), ours.stderr[-500:]


def test_inductor_graph_call_finds_no_graph_where_there_is_none():
    """Its real use (a compiled artifact's generated code, called directly, with the wrapped call's
    outputs) is tested on compiled and loaded regions in test_fusion.py."""
    from thunder_batch._compat import inductor_graph_call

    def wrapper(x):
        return plain(x)

    def plain(x):
        return x + 1

    assert inductor_graph_call(plain) is None and inductor_graph_call(wrapper) is None
