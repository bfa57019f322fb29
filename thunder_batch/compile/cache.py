"""Persistent compile cache: keys and the on-disk entry store (`compile.cache_listing` lists and clears them).

An entry is one JSON file `<root>/<key digest>.json` holding a traced step program as Python
source (see `trace_export`), its full key, a format version and a SHA-256 of its content. Entries
are code that will run, so a root that other users can write is refused. Any entry that is
damaged, stale or unloadable is a miss with one warning; the caller retraces and overwrites it.
Entries do not depend on the device index: the key names the device kind, and the stored source names
the CUDA device as `DEVICE_MARK`, put back as the store's own device on loading (`--devices 2`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path

FORMAT_VERSION = 4
ENV_VAR = "THUNDER_BATCH_CACHE_DIR"
DEFAULT_ROOT = "compile_cache"


DEVICE_MARK = "cuda:<device index>"  # in stored sources; not a device torch accepts, so never run as is
_CUDA_DEVICE = re.compile(r"""(["'])cuda:\d+\1""")  # torch.device("cuda:0") as traces print it


def portable_source(source: str) -> str:
    """`source` with every quoted CUDA device string ("cuda:1") written as DEVICE_MARK."""
    return _CUDA_DEVICE.sub(lambda m: f"{m[1]}{DEVICE_MARK}{m[1]}", source)


def local_source(source: str, device) -> str:
    """A stored source for `device` (a torch.device): DEVICE_MARK becomes its "cuda:<index>"."""
    if device is None or device.type != "cuda":
        return source
    return source.replace(DEVICE_MARK, f"cuda:{device.index or 0}")


class CompileCacheWarning(UserWarning):
    """A cache entry or root was not used (the step program is traced instead)."""


def warn(message: str) -> None:
    warnings.warn(message, CompileCacheWarning, stacklevel=3)


def resolve_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir` (--cache-dir), else $THUNDER_BATCH_CACHE_DIR, else ./compile_cache."""
    return Path(cache_dir or os.environ.get(ENV_VAR) or DEFAULT_ROOT)


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """Everything a traced piece of the step program depends on; its digest names the entry file."""

    piece: str  # prefix, block, head-<variant> (head-filtered, head-greedy_top, ...), or layers (blocks per layer)
    signature: str  # block programs: digest of the values Thunder checks on the block (else "")
    model_config: str  # canonical JSON of the litgpt Config
    module_signature: str  # SHA-256 over (name, shape, dtype) of every parameter/buffer and module class
    dtype: str
    device_kind: str
    batch_size: int
    rows: int  # N, the step's rows
    max_seq_length: int
    inputs: str  # shapes/dtypes of the call arguments
    executors: tuple[str, ...]  # the executors the piece was traced with, in claim order
    compile_options: str  # canonical JSON
    versions: tuple[tuple[str, str], ...]
    source: str  # SHA-256 of every package file a program can depend on (provenance.source_digest)
    codegen: str  # CPU: ISA flags, C++ compiler and version, Inductor's settings (provenance.codegen)
    native_kernels: str  # "available", why not, or "unused" (the project's executor is not in `executors`)

    def digest(self) -> str:
        return sha256(canonical_json(dataclasses.asdict(self)))[:32]


def versions() -> tuple[tuple[str, str], ...]:
    from thunder_batch.versions import package_versions

    packages = package_versions(("torch", "lightning-thunder", "litgpt", "thunder_batch"))
    return (("python", sys.version.split()[0]), *packages.items())


def native_kernels(executors: tuple[str, ...], device) -> str:
    """Whether the native kernels ran in programs traced with `executors` on `device`: a program traced
    while their build failed claims no linear, and must not be reused where they work (or back)."""
    from thunder_batch.compile.project_executor import EXECUTOR

    if EXECUTOR not in executors or device.type != "cpu":
        return "unused"
    from thunder_batch.native.build import unavailable

    return unavailable() or "available"


def module_signature(module) -> str:
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    parts = [(n, list(t.shape), str(t.dtype)) for n, t in tensors]
    # extra_repr: what a module's tensors do not show (a quantized linear's format, a norm's eps).
    parts += [(n, f"{type(m).__module__}.{type(m).__qualname__}", m.extra_repr()) for n, m in module.named_modules()]
    return sha256(canonical_json(parts))


def device_kind(device) -> str:
    import torch

    if device.type == "cuda":
        capability = "".join(map(str, torch.cuda.get_device_capability(device)))
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{capability}"
    return device.type


def make_key(program, config, executors: tuple[str, ...], options: dict) -> CacheKey:
    """The fields every piece of `program` (a StepProgram) traced with `executors` (names, claim order)
    and the other jit `options` (as data) shares; `piece_key` fills in the rest. Computed once per
    program and executor list: hashing the module and the sources is not free."""
    from thunder_batch.compile.provenance import codegen, source_digest

    weight = program.prefix.gpt.transformer.wte.weight
    return CacheKey(
        piece="",
        signature="",
        model_config=canonical_json(dataclasses.asdict(program.prefix.gpt.config)),
        module_signature=module_signature(program),
        dtype=str(weight.dtype),
        device_kind=device_kind(weight.device),
        batch_size=config.batch_size,
        rows=0,
        max_seq_length=config.max_seq_length,
        inputs="",
        executors=tuple(executors),
        compile_options=canonical_json(options),
        versions=versions(),
        source=source_digest(),
        codegen=codegen(weight.device.type),
        native_kernels=native_kernels(tuple(executors), weight.device),
    )


def tensor_meta(t) -> list:
    """What a key and a stored binding record of a tensor: shape, dtype, device type (not its index)."""
    return [list(t.shape), str(t.dtype), t.device.type]


def piece_key(base: CacheKey, piece: str, signature: str, args) -> CacheKey:
    """Key of one piece traced for call arguments `args` ([N, ...] first), from the program's key."""
    return dataclasses.replace(
        base,
        piece=piece,
        signature=signature,
        rows=int(args[0].shape[0]),
        inputs=canonical_json([tensor_meta(a) for a in args]),
    )


# -- the store ----------------------------------------------------------------------------------
class CompileCacheFiles:
    """Entries under one root. Refuses unsafe roots; falls back to memory only when it cannot write.
    `device`: where loaded programs run (the CUDA index of their sources); None leaves DEVICE_MARK."""

    def __init__(self, root: str | os.PathLike, device=None) -> None:
        self.root, self.device = Path(root), device
        self.readable = self.writable = False
        reason = self._open_root()
        if reason:
            warn(f"compile cache disabled, programs stay in memory only: {reason}")

    def _open_root(self) -> str | None:
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            return f"cannot create cache dir {str(self.root)!r} ({e.strerror or e})"
        reason = unsafe_reason(self.root, directory=True)
        if reason:
            return reason
        self.readable, self.writable = True, True
        return None

    def path(self, key: CacheKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def load(self, key: CacheKey) -> dict | None:
        """The stored record for `key`, or None (a miss). A bad entry warns once and is a miss."""
        path = self.path(key)
        if not self.readable or not path.exists():
            return None
        record, problem = read_entry(path, key)
        if problem:
            warn(f"compile cache entry {path.name} ignored, retracing: {problem}")
        if record is not None and "source" in record:
            record = dict(record, source=local_source(record["source"], self.device))
        return record

    def save(self, key: CacheKey, record: dict) -> bool:
        """Write atomically: readers and racing writers never see a torn entry."""
        if not self.writable:
            return False
        if "source" in record:
            record = dict(record, source=portable_source(record["source"]))
        body = dict(format=FORMAT_VERSION, key=dataclasses.asdict(key), created=time.time(), record=record)
        body["sha256"] = sha256(canonical_json(body))
        self.writable = write_atomically(self.path(key), canonical_json(body).encode())
        return self.writable


def write_atomically(path: Path, data: bytes) -> bool:
    """Write `data` to `path` through a temp file and a rename; False (with one warning) if it cannot."""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as e:
        warn(
            f"compile cache dir {str(path.parent)!r} is not writable ({e.strerror or e}); programs stay in memory only"
        )
        return False
    return True


def unsafe_reason(path: Path, directory: bool) -> str | None:
    """Why `path` must not be trusted (code from it will run), or None when it is ours alone."""
    info = path.stat()
    if directory != stat.S_ISDIR(info.st_mode):
        return f"{str(path)!r} is not a {'directory' if directory else 'regular file'}"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{str(path)!r} is owned by another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{str(path)!r} is writable by group or others (mode {stat.filemode(info.st_mode)}): entries are code"
    return None


def read_entry(path: Path, key: CacheKey | None) -> tuple[dict | None, str | None]:
    """(record, None) for a sound entry matching `key` (any key if None), else (None, what is wrong)."""
    try:
        reason = unsafe_reason(path, directory=False)
        if reason:
            return None, reason
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # unreadable, truncated, not JSON, not UTF-8
        return None, f"unreadable or truncated ({type(e).__name__}: {e})"
    if not isinstance(body, dict) or not {"format", "key", "record", "sha256"} <= body.keys():
        return None, "not a compile cache entry (fields missing)"
    stored_hash = body.pop("sha256")
    if stored_hash != sha256(canonical_json(body)):
        return None, "content hash mismatch (damaged or edited)"
    if body["format"] != FORMAT_VERSION:
        return None, f"stale format {body['format']!r} (this version writes {FORMAT_VERSION})"
    if key is not None and body["key"] != json.loads(canonical_json(dataclasses.asdict(key))):
        return None, "stale: written for different versions or settings"
    return body["record"], None
