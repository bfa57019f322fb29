"""`thunder-batch compile`: fill, list and clear the persistent compile cache.
Tables go to stdout; progress and timings to stderr. Listing and clearing are `compile.cache_listing`."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from thunder_batch.cli.options import EngineOptions
from thunder_batch.compile.cache import resolve_root
from thunder_batch.compile.cache_listing import clear_compile_cache, list_compile_cache


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
    again = Engine(engine.model, config, engine.tokenizer, engine.prompt_style)  # a fresh runner, same weights
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
    engine_options = EngineOptions(compile="thunder", **options)
    root = resolve_root(engine_options.cache_dir)
    if list or clear:
        list_compile_cache(root) if list else clear_compile_cache(root)
        return
    fill(replace(engine_options, cache_dir=str(root)), root)
