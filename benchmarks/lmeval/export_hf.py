"""Write a litgpt checkpoint as a transformers model dir (same fp32 weights, the checkpoint's own tokenizer
files), for lm-eval's `hf` model: python benchmarks/lmeval/export_hf.py CHECKPOINT_DIR OUT_DIR"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from thunder_batch.bench.hf_transformers import to_transformers
from thunder_batch.checkpoints import load_checkpoint


def main(checkpoint: str, out: str) -> None:
    gpt, _, _ = load_checkpoint(checkpoint, dtype=torch.float32)
    Path(out).mkdir(parents=True, exist_ok=True)
    to_transformers(gpt).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(checkpoint) / name, Path(out) / name)


if __name__ == "__main__":
    main(*sys.argv[1:])
