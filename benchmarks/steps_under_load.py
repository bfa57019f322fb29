"""The compiled decode step on a quiet machine and beside a busy process: how much of the CPU another
process takes from a step (a server's HTTP process and its clients share the cores with the engine).

Median `Engine.step()` of decode-only steps (as `step_proxy.py`: 64-token prompts of token ids, 2 threads,
the default model's weights), default executors, alternating rounds quiet and with a process that spins
`--busy-us` then sleeps `--idle-us` (100 / 400: ~20% of one core, 2,000 wake-ups a second).

    python benchmarks/steps_under_load.py --batch-sizes 1,8 --precision float32 --rounds 3 --steps 20
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch
from step_proxy import decode_step_arguments, decoding_engine, timed_steps

BUSY = "import time, sys\nb, i = float(sys.argv[1]) / 1e6, float(sys.argv[2]) / 1e6\nwhile True:\n"
BUSY += "    t = time.perf_counter()\n    while time.perf_counter() - t < b: pass\n    time.sleep(i)\n"


def busy_steps(engine, steps: int, busy_us: float, idle_us: float) -> list[float]:
    """`steps` timed steps while another process spins and sleeps in turn."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY, str(busy_us), str(idle_us)])
    try:
        time.sleep(0.2)
        return timed_steps(engine, steps)
    finally:
        busy.kill()
        busy.wait()


def main() -> None:
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

    parser = decode_step_arguments("float32", rounds=3, steps=20)
    parser.add_argument("--busy-us", type=float, default=100)
    parser.add_argument("--idle-us", type=float, default=400)
    args = parser.parse_args()
    torch.set_num_threads(2)
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=getattr(torch, args.precision))
    for batch_size in map(int, args.batch_sizes.split(",")):
        engine = decoding_engine(gpt, "thunder", batch_size, args.cache_dir)
        quiet, loaded = [], []
        for _ in range(args.rounds):
            quiet += timed_steps(engine, args.steps)
            loaded += busy_steps(engine, args.steps, args.busy_us, args.idle_us)
        q, b = (1e3 * statistics.median(t) for t in (quiet, loaded))
        print(
            f"{args.precision} B={batch_size}: decode step quiet {q:.2f} ms, beside the busy process {b:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
