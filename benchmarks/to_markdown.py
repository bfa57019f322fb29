"""The tables of a `thunder-batch bench --output-json` file as Markdown, for benchmarks/RESULTS.md.

python benchmarks/to_markdown.py results.json
"""

from __future__ import annotations

import json
import re
import sys

from thunder_batch.bench.output import decode_table, results_table, targets_table


def markdown(table) -> str:
    """A rich Table as a Markdown table (rich markup such as [red]...[/] dropped)."""
    headers = [str(c.header) for c in table.columns]
    rows = zip(*[[re.sub(r"\[/?[a-z ]*\]", "", str(cell)) for cell in c._cells] for c in table.columns])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main(path: str) -> None:
    result = json.loads(open(path, encoding="utf-8").read())
    for make in (results_table, decode_table, targets_table):
        print(markdown(make(result)), end="\n\n")


if __name__ == "__main__":
    main(sys.argv[1])
