"""`thunder-batch` dispatcher: subcommands from function signatures and docstrings (jsonargparse).

Each command is a module of this package (COMMANDS), imported only when the CLI starts, so a missing
optional dependency (the server's) makes that one command unavailable. The options the commands share
are declared once, in `options`. Text goes to stdout; timings, memory and logs to stderr.
"""

from __future__ import annotations

import importlib.util
import sys

# Subcommands: name -> (module, entry function).
COMMANDS = {
    "generate": ("thunder_batch.cli.generate", "generate"),
    "serve": ("thunder_batch.cli.serve", "serve"),
    "compile": ("thunder_batch.cli.compile", "compile_command"),
    "bench": ("thunder_batch.cli.bench", "bench"),
}


# Flags that collect a list when repeated (`--prompt a --prompt b`), jsonargparse's `--prompt+ a`.
REPEATABLE_FLAGS = ("--prompt", "--chat", "--stop")


# Switches that may stand alone (`--list` means `--list true`).
SWITCH_FLAGS = ("--list", "--clear", "--ignore_eos", "--profile", "--warm_compile", "--progress", "--int8_activations")


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
    commands = {}
    for name, (module, attr) in COMMANDS.items():
        try:
            commands[name] = getattr(__import__(module, fromlist=[attr]), attr)
        except ImportError as e:  # e.g. the server's extra dependency missing
            if importlib.util.find_spec(module) is not None:
                print(f"thunder-batch: '{name}' unavailable: {e}", file=sys.stderr)
    CLI(commands, args=argv, as_positional=False)


if __name__ == "__main__":
    main()
