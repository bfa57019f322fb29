"""`serve --replicas` on one machine: how replicas split its cores, what prefix-aware routing saves, what Ray costs.

    python benchmarks/replicas.py --out benchmarks/results/replicas        # the default model, compiled

1. Throughput: today's LitServe server (one worker, every core), one Ray replica with every core, and one
   replica per core, each at 8 and then 32 streaming chats sent at once (serve_speed.over_http: tokens/s,
   time to first token p50 / p99 / max), prefix reuse off (the 32 chats repeat the 8's prompts).
2. Routing: 2 replicas, --routing prefix against --routing least_loaded, on 8 conversations of 6 turns run
   side by side (each its own system prompt; every turn resends the conversation so far, as a chat client
   does): prompt tokens computed against those sent, over every replica, and later turns' TTFT p50.
3. Ray's cost per request: one-token completions one after another (p50, end to end), LitServe against one
   Ray replica on the same cores.
Systems run one after another on the same machine; each prints a JSON line, and a markdown table ends the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
from serve_speed import chats, over_http  # benchmarks/serve_speed.py
from soak import start_server  # benchmarks/soak.py: serve on a port, wait until /health says ok

QUESTIONS = [
    "What should I see first?",
    "How long does that take?",
    "Is it expensive?",
    "What about food nearby?",
    "Any tips for the evening?",
    "Summarize the plan in one sentence.",
]
CITIES = ["Lisbon", "Kyoto", "Lima", "Oslo", "Cairo", "Quebec", "Hanoi", "Perth"]


def serve(port: int, args, *extra: str) -> subprocess.Popen:
    return start_server(port, ["--compile", args.compile, "--batch_size", str(args.batch_size), *extra])


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(180)


def one_token_latency(url: str, n: int = 20) -> float:
    """p50 seconds of a one-token completion, end to end, one at a time (fresh prompts: no prefix hit)."""
    times = []
    for i in range(n):
        body = {"model": "m", "prompt": f"Request {i}: the weather is", "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        httpx.post(url + "/v1/completions", json=body, timeout=120).raise_for_status()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def throughput(args) -> list[dict]:
    systems = [("litserve 1 x all cores", []), ("ray 1 replica x all cores", ["--replicas", "1"])]
    systems += [(f"ray {os.cpu_count()} replicas x 1 core", ["--replicas", str(os.cpu_count())])]
    rows = []
    for name, extra in systems:
        proc = serve(args.port, args, "--prefix_reuse", "false", *extra)
        url = f"http://127.0.0.1:{args.port}"
        try:
            for clients in (8, 32):
                run = SimpleNamespace(url=url, clients=clients, max_tokens=args.max_tokens, model="m")
                rows.append(dict(part="throughput", system=name, **over_http(run)))
                print(json.dumps(rows[-1]), flush=True)
            if "--replicas" not in extra or extra[-1] == "1":
                rows.append(dict(part="one token", system=name, p50_ms=round(1000 * one_token_latency(url), 1)))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            stop(proc)
    return rows


def conversation(url: str, city: str, max_tokens: int, out: list) -> None:
    """Six turns, each resending the conversation so far; (turn, ttft) per turn into out."""
    system = f"You are a travel guide for {city}. " + chats(1)[0][0]["content"][:200]
    messages = [{"role": "system", "content": system}]
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": f"I am visiting {city}. {question}"})
        body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        sent, first, text = time.perf_counter(), None, ""
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    first = first or (time.perf_counter() if delta else None)
                    text += delta
        out.append((turn, (first or time.perf_counter()) - sent))
        messages.append({"role": "assistant", "content": text})


def prompt_counts(url: str) -> tuple[int, int]:
    replicas = httpx.get(url + "/stats", timeout=60).json()["replicas"]
    return sum(r["prompt_tokens"] for r in replicas), sum(r["prompt_tokens_computed"] for r in replicas)


def routing(args) -> list[dict]:
    rows = []
    for policy in ("prefix", "least_loaded"):
        proc = serve(args.port, args, "--replicas", "2", "--routing", policy)
        url = f"http://127.0.0.1:{args.port}"
        try:
            sent0, computed0 = prompt_counts(url)
            out: list = []
            start = time.perf_counter()
            threads = [threading.Thread(target=conversation, args=(url, c, args.turn_tokens, out)) for c in CITIES]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            sent, computed = prompt_counts(url)
            later = [ttft for turn, ttft in out if turn > 0]
            row = dict(part="routing", policy=policy, conversations=len(CITIES), turns=len(QUESTIONS))
            row.update(prompt_tokens=sent - sent0, computed=computed - computed0, wall_s=round(wall, 1))
            row.update(later_ttft_p50_s=round(statistics.median(later), 3), later_ttft_max_s=round(max(later), 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            stop(proc)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| system | chats | tok/s | TTFT p50 / p99 / max (s) |", "|---|---|---|---|"]
    for r in (r for r in rows if r["part"] == "throughput"):
        ttft = f"{r['ttft_p50_s']} / {r['ttft_p99_s']} / {r['ttft_max_s']}"
        lines.append(f"| {r['system']} | {r['clients']} | {r['tok_per_s']} | {ttft} |")
    lines += ["", "| routing | prompt tokens sent | computed | later turns' TTFT p50 / max (s) | wall (s) |"]
    lines.append("|---|---|---|---|---|")
    for r in (r for r in rows if r["part"] == "routing"):
        ttft = f"{r['later_ttft_p50_s']} / {r['later_ttft_max_s']}"
        lines.append(f"| {r['policy']} | {r['prompt_tokens']} | {r['computed']} | {ttft} | {r['wall_s']} |")
    lines += ["", "| one-token completion, p50 (ms) | |", "|---|---|"]
    lines += [f"| {r['system']} | {r['p50_ms']} |" for r in rows if r["part"] == "one token"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", default="thunder")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens per chat (throughput)")
    parser.add_argument("--turn_tokens", type=int, default=32, help="tokens per conversation turn (routing)")
    parser.add_argument("--port", type=int, default=18331)
    parser.add_argument("--parts", default="throughput,routing")
    parser.add_argument("--out", default=None, help="a folder for replicas.jsonl and replicas.md")
    args = parser.parse_args()
    flags = subprocess.run("lscpu | grep -E 'Model name|Flags'", shell=True, capture_output=True, text=True).stdout
    print("# " + flags.strip().replace("\n", "\n# "), flush=True)
    rows = []
    for part in args.parts.split(","):
        rows += {"throughput": throughput, "routing": routing}[part](args)
    print(table(rows))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "replicas.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (Path(args.out) / "replicas.md").write_text(flags + "\n" + table(rows) + "\n")


if __name__ == "__main__":
    main()
