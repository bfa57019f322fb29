"""Benchmark output for people: rich tables on stdout and a PNG plot."""

from __future__ import annotations

import math


def _f(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _compile(m: dict) -> str:
    c = m.get("compile") or {}
    if "cold_s" in c:
        return f"{_f(c['cold_s'])} / {_f(c.get('warm_s'))}"
    return f"({_f(c.get('first_step_s'), 2)})" if c else "-"


def _check(m: dict) -> str:
    check = m.get("token_check")
    if check is None:
        return "ref" if m.get("token_reference") else "-"
    bad = check["mismatched_requests"]
    return "ok" if bad == 0 else f"{bad}/{check['checked_requests']} differ"


RESULT_COLUMNS = (
    "system",
    "prec",
    "B",
    "out tok/s",
    "total tok/s",
    "req/s",
    "TTFT ms mean/p50/p99",
    "TPOT ms",
    "ITL ms p50/p99",
    "compile s cold/warm",
    "peak RSS MB",
    "occup.",
    "host %",
    "FLOP/s % peak",
    "x seq",
    "x hf",
    "greedy tokens",
)


def results_table(result: dict):
    from rich.table import Table

    table = Table(title=f"thunder-batch bench: {result['workload']['label']}", show_lines=False)
    for col in RESULT_COLUMNS:
        table.add_column(col, justify="left" if col in ("system", "greedy tokens") else "right")
    for m in result["runs"]:
        table.add_row(*_result_row(m))
    return table


def _result_row(m: dict) -> list[str]:
    """One run's cells, in RESULT_COLUMNS' order."""
    ttft, itl = m["ttft_ms"], m["itl_ms"]
    occ = m.get("slot_occupancy")
    return [
        m["system"],
        m["precision"],
        str(m["batch_size"] or 1),
        _f(m["output_tokens_per_s"]),
        _f(m["total_tokens_per_s"]),
        _f(m["requests_per_s"], 2),
        f"{_f(ttft['mean'], 0)}/{_f(ttft['p50'], 0)}/{_f(ttft['p99'], 0)}",
        _f(m["tpot_ms"]["mean"]),
        f"{_f(itl['p50'])}/{_f(itl['p99'])}",
        _compile(m),
        _f(m["memory"]["peak_rss_mb"], 0),
        "-" if occ is None else f"{100 * occ:.0f}%",
        "-" if "host" not in m else f"{100 * m['host']['share']:.1f}",
        _f(100 * m["peak_matmul_fraction"]),
        _f(m.get("speedup", {}).get("vs_litgpt_sequential"), 2),
        _f(m.get("speedup", {}).get("vs_hf"), 2),
        _check(m),
    ]


def targets_table(result: dict):
    from rich.table import Table

    table = Table(title="targets (best Thunder system per precision and batch size; best: fastest Thunder run)")
    for col in ("target", "where", "goal", "measured", "result"):
        table.add_column(col)
    for t in result["targets"]:
        mark = {True: "[green]met[/]", False: f"[red]{t['note']}[/]", None: t["note"]}[t["met"]]
        table.add_row(t["target"], t["where"], f"{t['goal']}", _f(t["measured"], 2), mark)
    return table


def decode_table(result: dict):
    from rich.table import Table

    table = Table(title="decode-only steps of engine runs (admit: median step with prefill lanes / decode-only)")
    cols = ("system", "prec", "B", "steps", "ms/step", "GFLOP/s", "% peak matmul", "GB/s", "% copy bw", "admit")
    for col in cols:
        table.add_column(col, justify="right")
    for m in result["runs"]:
        for key in ("full_decode", "decode"):
            d = m.get(key)
            if d:
                label = m["system"] + (" (all slots busy)" if key == "full_decode" else "")
                table.add_row(
                    label,
                    m["precision"],
                    str(m["batch_size"]),
                    str(d["steps"]),
                    _f(d["mean_step_ms"]),
                    _f(d["flops_per_s"] / 1e9),
                    _f(100 * d["peak_matmul_fraction"]),
                    _f(d["bytes_per_s"] / 1e9),
                    _f(100 * d["copy_bandwidth_fraction"]),
                    _f(m.get("admit_vs_decode_step"), 2),
                )
                break
    return table


def print_report(result: dict, file=None) -> None:
    from rich.console import Console

    console = Console(file=file, width=200)
    console.print(results_table(result))
    console.print(decode_table(result))
    console.print(targets_table(result))
    peaks = result["peaks"]
    matmul = ", ".join(f"{p} {v / 1e9:.1f}" for p, v in peaks["matmul_flops_per_s"].items())
    refs = ", ".join(f"{p}: {ref}" for p, ref in result["token_reference"].items()) or "none"
    console.print(
        f"peak matmul GFLOP/s {matmul}; copy bandwidth {peaks['copy_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(measured in this run); reference tokens per precision: {refs}"
    )
    kernels = result.get("meta", {}).get("linear_kernels")
    if kernels:  # native bf16 kernels read half the bytes of fp32 ones at decode rows: the fast path
        fast = " (bf16 weights are the fast path here)" if "torch" not in kernels["bfloat16"] else ""
        console.print(f"CPU linears: float32 {kernels['float32']}; bfloat16 {kernels['bfloat16']}{fast}")
    base = result.get("litgpt_sequential_baseline")
    if base:
        console.print(
            f"x seq: over litgpt-sequential {base['precision']} ({base['output_tokens_per_s']:.1f} tok/s, "
            "its fastest precision)"
        )
    if any("vs_hf" in m.get("speedup", {}) for m in result["runs"]):
        console.print("x hf: over the fastest Hugging Face transformers peer at the same B and precision")
    for m in result["runs"]:
        for note in m.get("notes", []):
            console.print(f"note ({m['system']} {m['precision']} B={m['batch_size']}): {note}")
    for name, why in result.get("skipped", {}).items():
        console.print(f"skipped {name}: {why}")
    for m in result["runs"]:
        if "profile" in m:
            prof = m["profile"]
            ops = ", ".join(f"{o['op']} {100 * o['fraction']:.0f}%" for o in prof["top_ops"][:6])
            console.print(
                f"profile {m['system']} {m['precision']} B={m['batch_size']} decode step "
                f"{prof['step_ms']:.0f} ms: {ops}"
            )


def plot(result: dict, path) -> None:
    """Left: output tokens/s vs batch size per system. Right: TTFT distribution (CDF) per run at the largest B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system, precision in dict.fromkeys((m["system"], m["precision"]) for m in runs):
        mine = [m for m in runs if (m["system"], m["precision"]) == (system, precision)]
        pts = sorted((m["batch_size"], m["output_tokens_per_s"]) for m in mine if m["batch_size"] is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{system} {precision}")
        else:
            style = "--" if precision == runs[0]["precision"] else ":"
            ax.axhline(
                mine[0]["output_tokens_per_s"],
                linestyle=style,
                color="gray",
                label=f"{system} {precision} (one at a time)",
            )
    ax.set(xlabel="batch size (slots)", ylabel="output tokens/s", title="throughput")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    largest = max((m["batch_size"] or 1) for m in runs)
    for m in runs:
        if (m["batch_size"] or largest) == largest and m.get("ttft_samples_ms"):
            xs = sorted(m["ttft_samples_ms"])
            bx.step(
                xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{m['system']} {m['precision']}"
            )
    bx.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title=f"TTFT distribution (B={largest})")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
