"""CLI argument handling (the commands themselves are tested with the real model and the server)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields

from thunder_batch.bench.options import BenchOptions
from thunder_batch.cli.main import normalize_flags


def test_dashed_flags_and_repeated_list_flags():
    argv = ["generate", "--batch-size", "4", "--max-new-tokens=3", "--prompt", "a b", "--prompt", "c", "--stop", "."]
    assert normalize_flags(argv) == [
        "generate",
        "--batch_size",
        "4",
        "--max_new_tokens=3",
        "--prompt+",
        "a b",
        "--prompt+",
        "c",
        "--stop+",
        ".",
    ]


def test_bare_switches_mean_true():
    assert normalize_flags(["compile", "--list"]) == ["compile", "--list", "true"]
    assert normalize_flags(["bench", "--ignore-eos", "--seed", "1"]) == ["bench", "--ignore_eos", "true", "--seed", "1"]
    assert normalize_flags(["compile", "--clear", "false"]) == ["compile", "--clear", "false"]


# The options the commands share, with their defaults: declared once (thunder_batch.cli), listed by every command.
MODEL_FLAGS = {"checkpoint_dir": "null", "precision": "float32", "int8_activations": "False"}
ENGINE_FLAGS = {
    **MODEL_FLAGS,
    "batch_size": "8",
    "max_seq_length": "1024",
    "prefill_chunk": "64",
    "cache_dir": "null",
    "prefix_reuse": "True",
    "speculative_tokens": "0",
    "forced_tokens": "null",
}
EXPECTED_FLAGS = {
    "generate": {**ENGINE_FLAGS, "compile": "thunder", "prompt": "null", "max_new_tokens": "64"},
    "serve": {
        **ENGINE_FLAGS,
        "compile": "thunder",
        "host": "127.0.0.1",
        "port": "8000",
        "replicas": "null",
        "ray_address": "null",
        "routing": "prefix",
        "replica_threads": "null",
    },
    "compile": {**ENGINE_FLAGS, "list": "False", "clear": "False"},
    "bench": {
        **MODEL_FLAGS,
        "batch_size": "8",
        "max_seq_length": "null",
        "prefill_chunk": "64",
        "cache_dir": "null",
        "systems": "litgpt-sequential,litgpt-batched,eager,thunder-default,thunder-torch,thunder-torchcompile,"
        "thunder-nvfuser,hf-transformers,hf-transformers-compile,llama.cpp",
        "precisions": "null",
        "llama_cpp_bin": "null",
        "llama_cpp_gguf": "null",
        "prefix_reuse": "True",
        "speculative_tokens": "0",
        "turns": "8",
        "repeats": "1",
        "dataset": "prompts",
        "num_requests": "32",
        "request_rate": "inf",
        "device": "cpu",
    },
}


def help_entries(text: str) -> dict[str, str]:
    """--flag -> its entry in jsonargparse's help (which may wrap over several lines)."""
    entries = re.split(r"\n  (?=--)", text.split("options:", 1)[1])
    return {name.group(1): entry for entry in entries if (name := re.match(r"--(\w+)", entry))}


def help_defaults(text: str) -> dict[str, str]:
    """--flag -> its default, from jsonargparse's help."""
    found = {}
    for name, entry in help_entries(text).items():
        flat = re.sub(r"\s+", "", entry)  # wrapping may split a default anywhere
        if default := re.search(r"default:(.*)\)$", flat):
            found[name] = default.group(1)
    return found


def documented(text: str) -> set[str]:
    """The flags whose help entry says something besides its type and default."""
    bodies = {name: re.split(r"\s{2,}", entry, maxsplit=1)[-1] for name, entry in help_entries(text).items()}
    return {name for name, body in bodies.items() if body.split("(type:")[0].strip()}  # after "--flag METAVAR"


def test_every_subcommand_lists_its_flags_and_defaults():
    for command, expected in EXPECTED_FLAGS.items():
        done = subprocess.run(
            [sys.executable, "-m", "thunder_batch.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, COLUMNS="100"),
        )
        assert done.returncode == 0, (command, done.stderr[-2000:])
        listed = help_defaults(done.stdout)
        assert {flag: listed.get(flag) for flag in expected} == expected, command
        assert ("compile" in listed) == (command in ("generate", "serve")), command
        if command == "bench":  # every option of the benchmark is a flag, with its doc
            assert {f.name for f in fields(BenchOptions)} <= documented(done.stdout)


def test_serve_refuses_replica_counts_below_one_before_loading_anything():
    for flag in ("--replicas=0", "--replica_threads=0"):
        done = subprocess.run(
            [sys.executable, "-m", "thunder_batch.cli", "serve", flag, "--checkpoint_dir", "/nonexistent"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        name = flag[2:].split("=")[0]
        assert done.returncode != 0 and f"{name} must be >= 1, got 0" in done.stderr, done.stderr[-2000:]
