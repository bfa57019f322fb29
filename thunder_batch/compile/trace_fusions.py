"""What compiled traces fuse: the fusion regions, the executor of each, the ops inside, and whether the
KV-cache write (the `scatter_` / `index_copy_` of compile.index_ops' lowering, or an operator writing the
caches itself, compile.attention's `WRITES_IN_PLACE`) runs inside one."""

from __future__ import annotations

from collections import Counter

from thunder_batch.compile.attention import WRITES_IN_PLACE

KV_WRITE_OPS = ("scatter", "index_copy", "index_put")


def _leaf_names(bsym) -> list[str]:
    """Names of the ops a bound symbol stands for, down to the ones with no subsymbols."""
    if not bsym.subsymbols:
        return [bsym.sym.name]
    return [name for sub in bsym.subsymbols for name in _leaf_names(sub)]


def _executor_name(bsym) -> str:
    executor = bsym.sym.executor
    return getattr(executor, "name", None) or type(executor).__name__


def _is_kv_write(name: str) -> bool:
    return name in WRITES_IN_PLACE or any(op in name.lower() for op in KV_WRITE_OPS)


def fusion_summary(traces: list) -> dict:
    """Over Thunder execution traces: fusion regions per executor, the regions holding a KV write, and
    the KV writes left outside any region (as 'op (executor)')."""
    by_executor: Counter = Counter()
    fused, unfused = [], []
    for trace in traces:
        for bsym in trace.bound_symbols:
            if bsym.sym.is_fusion:
                by_executor[_executor_name(bsym)] += 1
                writes = [n for n in _leaf_names(bsym) if _is_kv_write(n)]
                if writes:
                    fused.append(f"{bsym.sym.name} ({', '.join(sorted(set(writes)))})")
            elif _is_kv_write(bsym.sym.name):
                unfused.append(f"{bsym.sym.name} ({_executor_name(bsym) if bsym.sym.executor else 'no executor'})")
    return dict(
        traces=len(traces),
        regions=sum(by_executor.values()),
        regions_by_executor=dict(by_executor),
        kv_write_fused_in=fused,
        kv_write_unfused=unfused,
    )


def fusion_line(summary: dict) -> str:
    """One line: how many regions, of which executors, and where the KV write runs."""
    regions = ", ".join(f"{n} {name}" for name, n in summary["regions_by_executor"].items()) or "none"
    where = (
        f"KV write inside {len(summary['kv_write_fused_in'])} region(s): {', '.join(summary['kv_write_fused_in'])}"
        if summary["kv_write_fused_in"]
        else "KV write in no fusion"
    )
    if summary["kv_write_unfused"]:
        where += f"; outside: {', '.join(sorted(set(summary['kv_write_unfused'])))}"
    return f"{summary['regions']} fusion region(s) over {summary['traces']} traces ({regions}); {where}"
