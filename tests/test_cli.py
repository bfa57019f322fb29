"""CLI argument handling (the commands themselves are tested with the real model and the server)."""

from __future__ import annotations

import subprocess
import sys

from thunder_batch.cli import normalize_flags


def test_dashed_flags_and_repeated_list_flags():
    argv = ["generate", "--batch-size", "4", "--max-new-tokens=3", "--prompt", "a b", "--prompt", "c", "--stop", "."]
    assert normalize_flags(argv) == ["generate", "--batch_size", "4", "--max_new_tokens=3", "--prompt+", "a b",
                                     "--prompt+", "c", "--stop+", "."]


def test_bare_switches_mean_true():
    assert normalize_flags(["compile", "--list"]) == ["compile", "--list", "true"]
    assert normalize_flags(["bench", "--ignore-eos", "--seed", "1"]) == ["bench", "--ignore_eos", "true", "--seed", "1"]
    assert normalize_flags(["compile", "--clear", "false"]) == ["compile", "--clear", "false"]


def test_every_subcommand_has_help():
    for command in ("generate", "serve", "compile", "bench"):
        done = subprocess.run([sys.executable, "-m", "thunder_batch.cli", command, "--help"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert "--batch_size" in done.stdout, command
