"""Per-answer loglikelihoods of two lm-eval runs of mc40 (--log_samples), side by side: how far apart.
python benchmarks/lmeval/compare_samples.py SERVER_OUTPUT_DIR HF_OUTPUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def loglikelihoods(output_dir: str) -> dict[tuple[int, int], float]:
    [path] = sorted(Path(output_dir).rglob("samples_mc40_*.jsonl"))[-1:]
    out = {}
    for line in path.read_text().splitlines():
        sample = json.loads(line)
        for k, response in enumerate(sample["filtered_resps"]):
            out[sample["doc_id"], k] = float(response[0])
    return out


def main(server_dir: str, hf_dir: str) -> None:
    server, hf = loglikelihoods(server_dir), loglikelihoods(hf_dir)
    assert server.keys() == hf.keys(), "the runs scored different answers"
    diffs = [abs(server[k] - hf[k]) for k in hf]
    print(f"{len(diffs)} answers: max |server - hf| loglikelihood {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
