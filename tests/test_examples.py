"""Every example runs and prints what the README promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_is_token_identical_to_litgpt_with_three_traces():
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12/12 prompts token-identical to litgpt generate_fn" in done.stdout
    assert "cache_misses=3" in done.stdout
