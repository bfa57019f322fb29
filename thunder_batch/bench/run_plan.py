"""Which runs one benchmark makes: systems x precisions x batch sizes, with per-system restrictions.

`--systems` is a comma list of `name[@precision[/precision...]][:B[/B...]]`:

- `eager`: every precision of `--precisions` at every `--batch-size` (no restriction);
- `eager@bfloat16`: only in bfloat16, at every batch size;
- `thunder-torch@float32:32`: only in float32, only at B=32 (B need not be in `--batch-size`);
- `eager:32/64`: every precision, at B=32 and 64.

litgpt-sequential takes no B (one prompt at a time). A precision named in `--systems` must be one of
`--precisions`, so the weights it needs are converted up front and its peak matmul is measured.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL_SYSTEMS = (
    "litgpt-sequential",
    "litgpt-batched",
    "eager",
    "thunder-default",
    "thunder-torch",
    "thunder-torchcompile",
    "thunder-nvfuser",
    "hf-transformers",
    "hf-transformers-compile",
    "llama.cpp",
)
PRECISIONS = ("float32", "bfloat16", "float16")
SEQUENTIAL = "litgpt-sequential"


@dataclass(frozen=True)
class SystemSpec:
    name: str
    precisions: tuple[str, ...] | None = None  # None: every precision of the run
    batch_sizes: tuple[int, ...] | None = None  # None: every --batch-size


def parse_ints(value, name: str) -> list[int]:
    """ "1,4,8,16", 8 or [1, 4] -> sorted distinct ints; ValueError naming `name` otherwise."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    try:
        return sorted({int(str(v).strip()) for v in items if str(v).strip()})
    except ValueError:
        raise ValueError(f"{name} must be an int or a comma-separated list of ints, got {value!r}") from None


def parse_batch_sizes(value) -> list[int]:
    """ "1,4,8,16", 8 or [1, 4] -> sorted distinct positive ints."""
    sizes = parse_ints(value, "batch_size")
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {value!r}")
    return sizes


def parse_lengths(value, max_seq_length: int) -> tuple[int, ...] | None:
    """ "256,512" (or a list) -> the ladder's rungs that fit max_seq_length; None -> None (the default ladder)."""
    if value is None:
        return None
    return tuple(r for r in parse_ints(value, "attention_lengths") if r <= max_seq_length)


def parse_precisions(value, default: str) -> list[str]:
    """ "float32,bfloat16" -> ["float32", "bfloat16"] (order kept, duplicates dropped); None -> [default]."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return [default]
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    names = list(dict.fromkeys(str(v).strip() for v in items if str(v).strip()))
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        raise ValueError(f"unknown precision(s) {unknown}; choose from {list(PRECISIONS)}")
    return names


def parse_spec(item: str) -> SystemSpec:
    """ "thunder-torch@float32/bfloat16:32/64" -> SystemSpec."""
    rest, _, sizes = item.partition(":")
    name, _, precs = rest.partition("@")
    name = name.strip()
    if name not in ALL_SYSTEMS:
        raise ValueError(f"unknown system {name!r} in {item!r}; choose from {list(ALL_SYSTEMS)}")
    precisions = tuple(parse_precisions(precs.replace("/", ","), "")) if precs else None
    batch_sizes = tuple(parse_batch_sizes(sizes.replace("/", ","))) if sizes else None
    if batch_sizes and name == SEQUENTIAL:
        raise ValueError(f"{item!r}: litgpt-sequential runs one prompt at a time and takes no batch size")
    return SystemSpec(name, precisions, batch_sizes)


def parse_systems(value) -> list[SystemSpec]:
    items = list(value) if isinstance(value, (list, tuple)) else [s.strip() for s in str(value).split(",") if s.strip()]
    if not items:
        raise ValueError(f"unknown system(s) []; choose from {list(ALL_SYSTEMS)}")
    return list(dict.fromkeys(parse_spec(s) for s in items))


def plan_runs(specs: list[SystemSpec], precisions: list[str], sizes: list[int]) -> list[tuple[str, str, int | None]]:
    """(system, precision, B) of every run, in the order given, each once; B is None for litgpt-sequential."""
    runs = []
    for spec in specs:
        missing = [p for p in spec.precisions or () if p not in precisions]
        if missing:
            raise ValueError(
                f"system {spec.name} asks for {missing}, not in the run's precisions {precisions} "
                "(add them to --precisions)"
            )
        for precision in spec.precisions or precisions:
            for B in [None] if spec.name == SEQUENTIAL else (spec.batch_sizes or sizes):
                runs.append((spec.name, precision, B))
    return list(dict.fromkeys(runs))
