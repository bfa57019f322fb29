"""Backpressure that refuses only what the server cannot serve, on a live tiny server (the default model
cut to one layer, B=2, --max_waiting 2: capacity 4): closed-loop clients that cancel mid-stream, give up
after 0.5 s and send malformed bodies get no 429 while they are no more than the capacity, some 429s
when they are more, and nothing hangs; a client that gives up and retries at once is never refused for
its own abandoned request (its disconnect uncounts it as it arrives, not on a poll)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import KEY, ROOT, Server, cut_checkpoint

B, MAX_WAITING = 2, 2
HEADERS = {"Authorization": f"Bearer {KEY}"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from thunder_batch.checkpoints import default_checkpoint_dir

    checkpoint = cut_checkpoint(default_checkpoint_dir(ROOT / "checkpoints"), tmp_path_factory.mktemp("ckpt"), 1)
    args = [f"--batch_size={B}", "--max_seq_length=64", "--prefill_chunk=8", f"--max_waiting={MAX_WAITING}"]
    srv = Server(tmp_path_factory.mktemp("server") / "server.log", checkpoint, *args, "--api_key", KEY)
    yield srv
    srv.stop()


def one_request(url: str, rng: random.Random) -> str:
    """One request of the mix: 10% cancel mid-stream, 10% give up after 0.5 s, 10% malformed, the rest
    plain (half streamed). Returns what happened: the status, or "cancelled" / "gave up"."""
    kind = rng.random()
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": rng.randint(4, 40), "temperature": 0}
    try:
        if kind < 0.1:  # cancel mid-stream
            with httpx.stream("POST", url, json=dict(body, stream=True), headers=HEADERS, timeout=60) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                next(r.iter_lines())
            return "cancelled"
        if kind < 0.2:
            httpx.post(url, json=dict(body, max_tokens=50), headers=HEADERS, timeout=0.5)
            return "200"
        if kind < 0.3:
            return str(httpx.post(url, content=b'{"prompt": [', headers=HEADERS, timeout=60).status_code)
        stream = kind < 0.65
        with httpx.stream("POST", url, json=dict(body, stream=stream), headers=HEADERS, timeout=60) as r:
            r.read()
            return str(r.status_code)
    except httpx.TimeoutException:
        return "gave up"


def closed_loop(server: Server, clients: int, requests: int) -> dict[str, int]:
    url = server.url + "/v1/completions"

    def client(seed: int) -> list[str]:
        rng = random.Random(seed)
        return [one_request(url, rng) for _ in range(requests)]

    with ThreadPoolExecutor(clients) as pool:
        outcomes = [o for results in pool.map(client, range(clients)) for o in results]
    return {o: outcomes.count(o) for o in set(outcomes)}


def test_capacity_clients_with_cancels_timeouts_and_bad_bodies_get_no_429(server):
    start = time.monotonic()
    counts = closed_loop(server, B + MAX_WAITING, 30)
    assert "429" not in counts and sum(counts.values()) == 120, counts
    assert counts.get("200", 0) > 60 and counts.get("400") and counts.get("cancelled"), counts
    assert not [k for k in counts if k.startswith("5")], counts
    assert time.monotonic() - start < 300  # nothing hung
    server.wait_all_free()


def test_more_clients_than_capacity_get_429s_and_nothing_hangs(server):
    counts = closed_loop(server, 4 * (B + MAX_WAITING), 8)
    assert counts.get("429") and counts.get("200"), counts
    assert not [k for k in counts if k.startswith("5")], counts
    server.wait_all_free()


def test_a_client_that_retries_at_once_is_not_refused_for_its_own_abandoned_request(server):
    url = server.url + "/v1/completions"
    full = json.dumps({"model": "m", "prompt": ["a b c", "d e f"], "n": 2, "max_tokens": 60, "temperature": 0})
    gave_up = 0
    for _ in range(10):  # each try fills the whole capacity (2 prompts x n=2), then gives up after 0.3 s
        try:
            r = httpx.post(url, content=full, headers=HEADERS, timeout=0.3)
            assert r.status_code == 200, r.text  # done within 0.3 s: not refused either
        except httpx.TimeoutException:
            gave_up += 1
    assert gave_up >= 5  # the retries did meet their own abandoned requests
    r = httpx.post(url, content=full.replace('"max_tokens": 60', '"max_tokens": 2'), headers=HEADERS, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    server.wait_all_free()
