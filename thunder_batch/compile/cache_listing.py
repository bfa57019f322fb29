"""The compile cache root as a user sees it: list its entries (piece, shape, status), the fusion
regions' compiled code and Inductor's own caches, and clear them all. Tables go to stdout.
`thunder-batch compile --list/--clear` (cli.compile) prints these."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from thunder_batch.compile.cache import read_entry


def entry_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json")) if root.is_dir() else []


def list_compile_cache(root: Path) -> None:
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
    regions = sorted((root / "inductor").glob("*.bin"))
    if regions:
        size = sum(p.stat().st_size for p in regions) / 1e6
        print(f"  inductor/: {len(regions)} compiled fusion region(s), {size:.1f} MB (loaded by the entries above)")
    caches = root / "inductor-cache"
    if caches.is_dir():
        size = sum(p.stat().st_size for p in caches.rglob("*") if p.is_file()) / 1e6
        print(f"  inductor-cache/: Inductor's own caches, {size:.1f} MB")


def clear_compile_cache(root: Path) -> None:
    """Delete entries, compiled fusion regions, Inductor's caches and leftover temp files; anything
    else in the root (e.g. a README) stays."""
    removed = 0
    regions = root / "inductor"
    for path in [*entry_files(root), *(root.glob(".*.tmp") if root.is_dir() else ()), *regions.glob("*.bin")]:
        path.unlink(missing_ok=True)
        removed += 1
    for folder in (root / "inductor-cache", regions):
        if folder.is_dir():
            shutil.rmtree(folder)
    print(f"{root}: removed {removed} file(s) and Inductor's caches")
