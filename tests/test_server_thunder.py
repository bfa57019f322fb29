"""`thunder-batch serve --compile thunder`: a real server process whose step programs are traced by
Thunder at startup and stored in the compile cache; a second server loads them from disk. Answers are
checked against an eager engine on the same checkpoint (the eager path is the oracle for the compiled one).
Then the server under load: two Thunder workers from the warm cache take a burst of 4x their capacity
(429s, no 5xx, every answer the request's own), and two eager workers lose one to SIGKILL mid-run
(its requests get 503, /health says so until LitServe has replaced it); nothing is left behind.

The checkpoint is the default model cut to its first two layers (real tokenizer, real weights), so a
cold start traces in seconds instead of minutes; slow-marked with the other server-process tests."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from live_server import KEY, ROOT, Server, cut_checkpoint

ENGINE = dict(batch_size=4, max_seq_length=64, prefill_chunk=8)
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fib(n):",
    "Water boils at",
    "The quick brown fox",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def two_layer_checkpoint(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's embeddings, first two blocks, final norm and tokenizer, in a dir of the
    same name (litgpt picks the tokenizer's BOS handling and the chat template from that name)."""
    from thunder_batch.checkpoints import default_checkpoint_dir

    return cut_checkpoint(default_checkpoint_dir(ROOT / "checkpoints"), tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def offline_engine(two_layer_checkpoint):
    from thunder_batch import Engine, EngineConfig

    return Engine.from_checkpoint(two_layer_checkpoint, EngineConfig(compile="eager", **ENGINE))


@pytest.fixture(scope="module")
def expected(offline_engine) -> list[str]:
    from thunder_batch import SamplingParams

    return [r.text for r in offline_engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_TOKENS))]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """One compile cache for the module: the first test fills it, the load test starts warm."""
    return tmp_path_factory.mktemp("compile") / "cache"


def completions(server: Server) -> list[str]:
    """All prompts at once from parallel clients (more requests than slots), greedy."""

    def one(prompt: str) -> str:
        reply = server.client().completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.usage.completion_tokens == MAX_TOKENS
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.slow
def test_thunder_server_traces_once_then_loads_from_the_compile_cache(
    two_layer_checkpoint, expected, cache_dir, tmp_path
):
    assert not cache_dir.exists(), "this test runs first in its module, on an empty cache"
    args = [f"--{k}={v}" for k, v in ENGINE.items()] + ["--cache_dir", str(cache_dir)]
    # Cold: per shape a prefix, three heads and the block (4 shapes: decode only, 1, 2 and 4 lanes: 20
    # programs; the second layer is traced once more at the first shape, to learn that block_idx does
    # not matter). Warm: all loaded.
    for run, (traced, loaded) in enumerate([(21, 0), (0, 20)]):
        server = Server(tmp_path / f"server{run}.log", two_layer_checkpoint, *args, compile="thunder")
        try:
            assert completions(server) == expected
            stats = server.wait_all_free()
            # Every step shape made once at startup (traced cold, loaded warm); no request retraced.
            assert stats["cache_misses"] == 4
            assert (stats["traced"], stats["disk_cache_hits"]) == (traced, loaded), stats
            heads = {"head-filtered": 4, "head-unsorted": 4, "head-greedy": 4}
            assert stats["programs"] == {"prefix": 4, "block": 4, **heads}
            assert stats["cache_hits"] > 0
        finally:
            assert server.stop() == 0, server.log()
    assert len(list(cache_dir.glob("*.json"))) == 24  # 20 pieces and each shape's block layout


# -- under load ---------------------------------------------------------------------------------
MAX_WAITING = 4
CAPACITY = 2 * (ENGINE["batch_size"] + MAX_WAITING)  # two workers


def post(server: Server, i: int, temperature: float, timeout: float = 120) -> httpx.Response:
    """Completion i of the load: PROMPTS[i % 6], greedy or seeded, with its own X-Request-Id."""
    fields = dict(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS, temperature=temperature, seed=i)
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": f"load-{i}"}
    return httpx.post(server.url + "/v1/completions", json=fields, headers=headers, timeout=timeout)


def rss(server: Server) -> int:
    return sum(p.memory_info().rss for p in server.family())


@pytest.mark.slow
def test_a_burst_of_four_times_capacity_gets_429s_and_every_answer_is_its_own(
    two_layer_checkpoint, offline_engine, expected, cache_dir, tmp_path
):
    from thunder_batch import SamplingParams

    args = [f"--{k}={v}" for k, v in ENGINE.items()] + ["--cache_dir", str(cache_dir), "--api_key", KEY]
    args += ["--workers_per_device", "2", "--max_waiting", str(MAX_WAITING)]
    server = Server(tmp_path / "load.log", two_layer_checkpoint, *args, compile="thunder")
    try:
        warm = [post(server, i, 0.0) for i in range(len(PROMPTS))]  # the request path warmed up
        assert [r.json()["choices"][0]["text"] for r in warm] == expected
        server.wait_all_free()
        family, memory = {p.pid for p in server.family()}, rss(server)
        stats = server.stats()
        assert stats["traced"] == 0 and stats["disk_cache_hits"] == 40  # both workers loaded every piece

        n = 4 * CAPACITY
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda i: post(server, i, 1.0 if i % 2 else 0.0), range(n)))
        statuses = [r.status_code for r in replies]
        assert set(statuses) <= {200, 429} and statuses.count(429) >= n // 2, statuses
        assert [r.headers["x-request-id"] for r in replies] == [f"load-{i}" for i in range(n)]
        for i, r in enumerate(replies):
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
                continue
            text = r.json()["choices"][0]["text"]
            if i % 2 == 0:  # greedy: the request alone
                assert text == expected[i % len(PROMPTS)], i
            else:  # seeded: the same tokens as this request alone offline
                params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=1.0, seed=i)
                assert text == offline_engine.generate([PROMPTS[i % len(PROMPTS)]], params)[0].text, i

        stats = server.wait_all_free()
        assert stats["cancels_pending"] == 0 and stats["free_slots"] == 2 * ENGINE["batch_size"]
        assert stats["cache_misses"] == 8 and stats["traced"] == 0  # no request retraced on either worker
        assert {p.pid for p in server.family()} == family  # no process left behind, none lost
        assert rss(server) < 1.1 * memory, (rss(server), memory)
    finally:
        assert server.stop() == 0, server.log()


def stream(server: Server, i: int, out: dict) -> None:
    """A streamed completion: (status, its parsed events or JSON body), or the exception that ended it."""
    body = dict(model="m", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=40, temperature=0, stream=True)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
            if r.status_code != 200:
                out[i] = (r.status_code, json.loads("".join(lines)))
            else:
                out[i] = (200, [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines])
    except Exception as e:  # a hung or cut stream is what this test looks for
        out[i] = (None, e)


def worker_died(result) -> bool:
    """Whether a result is the answer to a request whose worker died: a 503, or a stream's error event."""
    status, got = result
    if status == 503:
        return got["error"]["code"] == "worker_died"
    return status == 200 and "error" in got[-2] and got[-2]["error"]["code"] == "worker_died"


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_requests_get_a_503(two_layer_checkpoint, expected, tmp_path):
    args = [f"--{k}={v}" for k, v in ENGINE.items()] + ["--api_key", KEY, "--workers_per_device", "2"]
    server = Server(tmp_path / "kill.log", two_layer_checkpoint, *args, compile="eager")
    try:
        family = {p.pid for p in server.family()}
        out: dict = {}
        threads = [threading.Thread(target=stream, args=(server, i, out)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not any(w["running"] for w in server.stats()["workers"]):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        victim = next(w for w in server.stats()["workers"] if w["running"])
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10  # LitServe's monitor notices within ~2 s
        while server.health().text == "ok":
            assert time.monotonic() < deadline, "/health must say a worker is gone"
            time.sleep(0.1)
        health = server.health()  # the other worker serves: degraded, still 200 for a load balancer
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert "worker %d" % victim["index"] in health.text
        server.wait_healthy(timeout=120)  # the replacement has loaded the model
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "no request is left hanging"
        for status, got in out.values():
            assert status in (200, 503), got
            if status == 200:
                assert got[-1] == "[DONE]" and ("error" in got[-2] or got[-2]["choices"][0]["finish_reason"]), got
        dead = [r for r in out.values() if worker_died(r)]
        assert dead and all(worker_died(r) or r[1][-2]["choices"][0]["finish_reason"] for r in out.values())
        replacement = server.stats()["workers"][victim["index"]]
        assert replacement["pid"] != victim["pid"] and replacement["ready"]
        assert completions(server) == expected  # both workers serve again
        stats = server.wait_all_free()
        assert stats["cancels_pending"] == 0 and stats["free_slots"] == 2 * ENGINE["batch_size"]
        assert {p.pid for p in server.family()} == family - {victim["pid"]} | {replacement["pid"]}
    finally:
        assert server.stop() == 0, server.log()
