"""`thunder-batch compile`: fill, list and clear the persistent compile cache.
Tables go to stdout; progress and timings to stderr."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from thunder_batch.compile.cache import read_entry, resolve_root


def entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json")) if root.is_dir() else []


def list_entries(root: Path) -> None:
    """One line per entry: digest, piece, model, B and rows N, cache length, dtype, device, size, age, status."""
    files = entry_files(root)
    print(f"{root}: {len(files)} entr{'y' if len(files) == 1 else 'ies'}")
    for path in files:
        record, problem = read_entry(path, None)
        try:
            key = json.loads(path.read_text(encoding="utf-8"))["key"]
            model = json.loads(key["model_config"]).get("name", "?")
            piece = key["piece"] + (f" {key['signature'][:8]}" if key["signature"] else "")
            shape = f"B={key['batch_size']} N={key['rows']} S={key['max_seq_length']}"
            where = f"{key['dtype'].removeprefix('torch.')} {key['device_kind']} {','.join(key['executors'])}"
        except (OSError, ValueError, KeyError, TypeError):
            piece, model, shape, where = "?", "?", "?", "?"
        age_h = (time.time() - path.stat().st_mtime) / 3600
        status = "ok" if record is not None else f"BAD: {problem}"
        size_mb = path.stat().st_size / 1e6
        print(f"  {path.stem}  {piece:<15}  {model}  {shape}  {where}  {size_mb:.2f} MB  {age_h:.1f} h  {status}")


def clear_entries(root: Path) -> None:
    """Delete entries and leftover temp files; anything else in the root (e.g. a README) stays."""
    removed = 0
    for path in [*entry_files(root), *(root.glob(".*.tmp") if root.is_dir() else ())]:
        path.unlink(missing_ok=True)
        removed += 1
    print(f"{root}: removed {removed} file(s)")


def fill(options, root: Path) -> None:
    """Trace (or load) every piece of every step shape into the cache, then load all of them again
    from disk as a fresh engine would, and print both times. `options`: the command's EngineOptions."""
    from thunder_batch.engine import Engine

    engine = options.load_engine()
    config = engine.config
    first = sum(engine.warmup(progress=True).values())
    stats = engine.stats()
    print(
        f"first pass: {first:.1f}s ({stats['traced']} pieces traced, {stats['disk_cache_hits']} already cached; "
        f"programs per piece {stats['programs']})",
        file=sys.stderr,
    )
    again = Engine(engine.runner.gpt, config, engine.tokenizer, engine.prompt_style)  # a fresh runner, same weights
    warm = sum(again.warmup(progress=True).values())
    loaded = again.stats()["disk_cache_hits"]
    print(
        f"warm (loaded from {root}): {warm:.1f}s, {loaded} pieces loaded for {len(config.step_shapes)} step shapes",
        file=sys.stderr,
    )
    print(
        json.dumps(
            dict(
                cache_dir=str(root),
                step_shapes=[shape.describe(config) for shape in config.step_shapes],
                first_pass_s=round(first, 2),
                traced=stats["traced"],
                programs=stats["programs"],
                warm_s=round(warm, 2),
                loaded=loaded,
            )
        )
    )


def compile_command(list: bool = False, clear: bool = False, **options) -> None:
    """Fill the persistent compile cache for a model and config, and print cold vs warm compile time.

    Args:
        list: Show the entries in the cache root instead of compiling.
        clear: Delete every entry in the cache root instead of compiling.
    """
    from thunder_batch.cli import EngineOptions

    engine_options = EngineOptions(compile="thunder", **options)
    root = resolve_root(engine_options.cache_dir)
    if list or clear:
        list_entries(root) if list else clear_entries(root)
        return
    fill(replace(engine_options, cache_dir=str(root)), root)
