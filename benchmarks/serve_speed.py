"""The engine's speed through HTTP: C concurrent streaming chat clients (greedy, --max_tokens each) against
an OpenAI-compatible server, and the offline engine on the same requests in this process.

    python benchmarks/serve_speed.py --url http://127.0.0.1:8000 --clients 8       # any server (llama-server too)
    python benchmarks/serve_speed.py --offline --batch_size 8 --compile thunder      # Engine.generate, same requests

Each client sends one chat request at the same moment and reads its stream; reported: generated tokens
per second over the whole run (tokens counted from each stream's usage chunk), time to first token
(p50 and max) and inter-token latency p50. The offline run is Engine.generate on the same chats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from importlib import resources

import httpx


def chats(n: int) -> list[list[dict]]:
    lines = resources.files("thunder_batch.data").joinpath("prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines]
    return [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(n)]


def one_client(url: str, messages: list, max_tokens: int, ready: threading.Barrier, out: list, model: str) -> None:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Each client is made before the start: making one costs ~25 ms of this process's CPU (its TLS
    # context), which for 8 clients sent at once would be counted as the server's time to first token.
    with httpx.Client(timeout=600) as client:
        ready.wait()
        sent, times, tokens = time.perf_counter(), [], 0
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    times.append(time.perf_counter())
    out.append((sent, times, tokens))


def over_http(args) -> dict:
    messages = chats(args.clients)
    before, ready, out = server_steps(args.url), threading.Barrier(len(messages) + 1), []
    threads = [
        threading.Thread(target=one_client, args=(args.url, m, args.max_tokens, ready, out, args.model))
        for m in messages
    ]
    for t in threads:
        t.start()
    ready.wait()  # every client made: they send now
    begin = time.perf_counter()
    for t in threads:
        t.join()
    wall = max(times[-1] for _, times, _ in out if times) - begin
    ttft = [times[0] - sent for sent, times, _ in out if times]
    itl = [b - a for _, times, _ in out for a, b in zip(times, times[1:])]
    tokens = sum(n for *_, n in out)
    return dict(
        clients=args.clients,
        tokens=tokens,
        tok_per_s=round(tokens / wall, 1),
        ttft_p50_s=round(statistics.median(ttft), 3),
        ttft_p99_s=round(statistics.quantiles(ttft, n=100, method="inclusive")[98], 3) if len(ttft) > 1 else None,
        ttft_max_s=round(max(ttft), 3),
        itl_p50_ms=round(1000 * statistics.median(itl), 1) if itl else None,
        steps=steps_between(before, server_steps(args.url)),
    )


def server_steps(url: str) -> dict:
    """shape -> (count, seconds) from a thunder-batch server's step histogram, summed over its replicas ({} from
    other servers)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    steps: dict = {}
    for line in text.splitlines():
        for part, index in (("_count{", 0), ("_sum{", 1)):
            if line.startswith("thunder_batch:step_duration_seconds" + part):
                shape = line.split('shape="')[1].split('"')[0]
                steps.setdefault(shape, [0.0, 0.0])[index] += float(line.rsplit(" ", 1)[1])
    return steps


def steps_between(before: dict, after: dict) -> dict:
    """The steps of one run, as "count x mean ms" per shape (a histogram keeps sums, not medians)."""
    out = {}
    for shape, (count, total) in after.items():
        count0, total0 = before.get(shape, (0, 0.0))
        if count > count0:
            out[shape] = f"{count - count0:.0f} x {1000 * (total - total0) / (count - count0):.0f} ms (mean)"
    return out


def load_engine(args):
    from thunder_batch import Engine, EngineConfig

    config = EngineConfig(batch_size=args.batch_size, max_seq_length=args.max_seq_length, compile=args.compile)
    engine = Engine.from_checkpoint(args.checkpoint_dir, config)
    if args.compile == "thunder":
        engine.warmup()
    steps: dict = {}  # shape -> list of step seconds (as the server's worker times them for /metrics)
    engine.observers.add(lambda event: steps.setdefault(event.shape_name, []).append(event.seconds))
    return engine, steps


def offline(engine_and_steps: tuple, args) -> dict:
    from thunder_batch import SamplingParams

    engine, steps = engine_and_steps
    params = SamplingParams(max_new_tokens=args.max_tokens, temperature=0)
    engine.generate([[{"role": "user", "content": "Hello."}]], params)  # untimed: first-call costs out of the way
    steps.clear()
    begin = time.perf_counter()
    results = engine.generate(chats(args.clients), params)
    wall = time.perf_counter() - begin
    tokens = sum(len(r.token_ids) for r in results)
    return dict(clients=args.clients, tokens=tokens, tok_per_s=round(tokens / wall, 1), steps=summary(steps))


def summary(steps: dict) -> dict:
    """shape -> "count x median ms", as the server's /metrics step histogram can be read."""
    return {k: f"{len(v)} x {1000 * statistics.median(v):.0f} ms" for k, v in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="m")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--offline", action="store_true", help="Engine.generate in this process instead")
    parser.add_argument("--checkpoint_dir", default=None)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_seq_length", type=int, default=1024)
    parser.add_argument("--compile", default="thunder")
    parser.add_argument("--runs", type=int, default=1, help="run the same requests this many times (prefixes kept)")
    args = parser.parse_args()
    engine = load_engine(args) if args.offline else None
    for _ in range(args.runs):
        print(json.dumps(offline(engine, args) if args.offline else over_http(args)), flush=True)


if __name__ == "__main__":
    main()
