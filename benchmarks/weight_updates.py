"""What following the caller's weights costs on the default model, compiled, decoding B requests:
- the look before every step (`Runner.follow_weights` with nothing changed), beside the step it precedes;
- `Engine.update_weights(state_dict)` (every weight copied in place, packed copies made again), and the
  step after it (the layers' native loop recorded and checked again);
- `Engine.refresh_weights()`, and `load_state_dict(sd, assign=True)` followed at the next step;
with Thunder's trace count before and after (a retrace would show).

    python benchmarks/weight_updates.py --batch-size 8 --precision float32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from step_proxy import decoding_engine, timed_steps


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(engine, gpt, new: dict) -> dict:
    looks = [seconds(engine.runner.follow_weights) for _ in range(200)]
    steps = timed_steps(engine, 10)
    update = seconds(lambda: engine.update_weights(new))
    after_update = timed_steps(engine, 3)
    refresh = seconds(engine.refresh_weights)
    after_refresh = timed_steps(engine, 3)
    gpt.load_state_dict({name: t.clone() for name, t in new.items()}, assign=True)
    after_assign = timed_steps(engine, 3)
    return dict(
        look_us=statistics.median(looks) * 1e6,
        step_ms=statistics.median(steps) * 1e3,
        update_weights_s=update,
        steps_after_update_ms=[t * 1e3 for t in after_update],
        refresh_weights_s=refresh,
        steps_after_refresh_ms=[t * 1e3 for t in after_refresh],
        steps_after_assign_ms=[t * 1e3 for t in after_assign],
    )


def main() -> None:
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = getattr(torch, args.precision)
    gpt, _, _ = load_checkpoint(default_checkpoint_dir(), dtype=dtype)
    engine = decoding_engine(gpt, "thunder", args.batch_size, args.cache_dir)
    traces = engine.stats()["thunder_traces"]
    new = {name: t * 0.999 for name, t in gpt.state_dict().items()}  # other values, the same shapes and dtype
    rounds = [one_round(engine, gpt, new) for _ in range(args.rounds)]
    stats = engine.stats()
    print(
        json.dumps(
            dict(
                batch_size=args.batch_size,
                precision=args.precision,
                parameters=sum(t.numel() for t in gpt.parameters()),
                weight_tensors=len(list(gpt.parameters())),
                thunder_traces_before=traces,
                thunder_traces_after=stats["thunder_traces"],
                stacked_shapes=stats["stacked_shapes"],
                rounds=rounds,
            ),
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
