"""`thunder-batch serve --replicas 2` on a real local Ray instance (loopback only, one torch thread per
replica, the default model cut to one layer, eager): answers equal the offline engine's and spread over both
replicas; a conversation's turns stay on one replica and reuse its prefix; a `user` pins short prompts;
/health, /stats and /metrics cover every replica; a replica killed mid-stream ends that stream with a clean
error while the other serves and Ray replaces it; a stopped replica is found by its health check; a client
that hangs up frees its slot; SIGTERM drains the stream in flight and every process exits."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from test_server_faults import BODY, HEADERS, stream_one

from live_server import KEY, ROOT, Server, cut_checkpoint

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow
ARGS = ["--replicas=2", "--batch_size=2", "--max_seq_length=256", "--prefill_chunk=8", "--api_key", KEY]
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, name prices in euros, "
    "never invent opening hours, and say so when you do not know an answer to a question."
)
QUESTIONS = ["What bread do you sell?", "Is it fresh?", "How much is it?", "Do you deliver?", "On Sundays?"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from thunder_batch.checkpoints import default_checkpoint_dir

    return cut_checkpoint(default_checkpoint_dir(ROOT / "checkpoints"), tmp_path_factory.mktemp("ckpt"), 1)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("ray") / "ray.log", checkpoint, *ARGS, "--worker_timeout=10")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """prompt -> the engine's own greedy text for BODY's max_tokens, run in this process."""
    import torch

    from thunder_batch import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(1)
    config = EngineConfig(batch_size=2, max_seq_length=256, prefill_chunk=8, compile="eager")
    engine = Engine.from_checkpoint(checkpoint, config)
    return lambda prompt, tokens=8: engine.generate([prompt], SamplingParams(max_new_tokens=tokens))[0].text


def replicas(server: Server) -> dict[str, dict]:
    return {r["replica"]: r for r in server.stats()["replicas"]}


def finished(server: Server) -> dict[str, int]:
    return {k: r.get("finished_requests", 0) for k, r in replicas(server).items()}


def complete(server: Server, prompt: str, **extra) -> dict:
    body = dict(BODY, prompt=prompt, **extra)
    r = httpx.post(server.url + "/v1/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_answers_equal_the_offline_engine_and_spread_over_both_replicas(server, offline):
    prompts = [f"Story number {i}: once upon a time there was" for i in range(8)]
    before = finished(server)
    answers: dict = {}
    threads = [threading.Thread(target=lambda p=p: answers.update({p: complete(server, p)})) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt in prompts:
        assert answers[prompt]["choices"][0]["text"] == offline(prompt), prompt
    after = finished(server)
    served = {k: after[k] - before.get(k, 0) for k in after}
    assert len(served) == 2 and sum(served.values()) == len(prompts) and min(served.values()) > 0, served


def test_a_conversation_stays_on_one_replica_and_reuses_its_prefix(server):
    client, messages = server.client(), [{"role": "system", "content": SYSTEM}]
    before = replicas(server)
    for question in QUESTIONS + QUESTIONS[:3]:  # 8 turns, no session header: the prefix routes them
        messages.append({"role": "user", "content": question})
        answer = client.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    after = replicas(server)
    turns = {k: after[k]["finished_requests"] - before.get(k, {}).get("finished_requests", 0) for k in after}
    holder = max(turns, key=turns.get)
    assert turns[holder] == 8, turns
    reused = after[holder]["prompt_tokens_reused"] - before.get(holder, {}).get("prompt_tokens_reused", 0)
    assert reused > 7 * 30, (reused, after[holder])  # every later turn reads at least the system prompt again


def test_a_user_pins_short_prompts_to_one_replica(server):
    before = finished(server)
    for i in range(6):
        complete(server, f"Hi {i}", user="alice", max_tokens=2)
    after = finished(server)
    served = sorted(after[k] - before.get(k, 0) for k in after)
    assert served == [0, 6], served


def test_health_stats_and_metrics_cover_every_replica(server):
    assert server.health().text == "ok"
    stats = server.stats()
    assert len(stats["replicas"]) == 2 and stats["batch_size"] == 4 and stats["in_flight"] == 0
    text = server.metrics()
    ids = {r["replica"] for r in stats["replicas"]}
    slots = [line for line in text.splitlines() if line.startswith("thunder_batch:num_slots{")]
    assert sorted(line.split('replica="')[1].split('"')[0] for line in slots) == sorted(ids), slots
    assert all(line.endswith(" 2.0") for line in slots), slots
    assert "thunder_batch:request_success_total" in text  # the ingress's own series
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), types  # each family declared once, or a scrape fails
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401  # the same auth
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=HEADERS)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_client_that_hangs_up_frees_its_slot(server):
    body = dict(BODY, max_tokens=200, stream=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token came: hang up
    deadline = time.monotonic() + 30
    while sum(r["running"] for r in replicas(server).values()) or server.stats()["in_flight"]:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.2)


def busy_replica(server: Server, out: dict) -> dict:
    """The replica running the stream `out` is reading, once its first token came."""
    deadline = time.monotonic() + 60
    while not out.get("first"):
        assert time.monotonic() < deadline, out
        time.sleep(0.01)
    [busy] = [r for r in replicas(server).values() if r["running"]]
    return busy


def test_a_killed_replica_ends_its_stream_cleanly_the_other_serves_and_ray_replaces_it(server, offline):
    out: dict = {}
    client = threading.Thread(target=stream_one, args=(server.url, out, 200))
    client.start()
    victim = busy_replica(server, out)
    os.kill(victim["pid"], signal.SIGKILL)
    client.join(60)
    error = json.loads(out["lines"][-2].removeprefix("data: "))
    assert error["error"]["code"] == "worker_died" and out["lines"][-1] == "data: [DONE]", out
    health = server.health()
    assert health.status_code == 200 and health.json()["status"].startswith("degraded: 1 of 2"), health.text
    assert complete(server, "Water boils at")["choices"][0]["text"] == offline("Water boils at")
    server.wait_healthy(timeout=180)
    assert victim["pid"] not in {r["pid"] for r in replicas(server).values()}


def test_a_stopped_replica_fails_its_health_check_and_is_replaced(server):
    out: dict = {}
    client = threading.Thread(target=stream_one, args=(server.url, out, 200))
    client.start()
    victim = busy_replica(server, out)
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        client.join(90)
        error = json.loads(out["lines"][-2].removeprefix("data: "))
        assert error["error"]["code"] == "worker_died", out
    finally:
        if psutil.pid_exists(victim["pid"]):
            os.kill(victim["pid"], signal.SIGCONT)
    server.wait_healthy(timeout=180)
    assert victim["pid"] not in {r["pid"] for r in replicas(server).values()}


def test_sigterm_drains_the_stream_in_flight_and_every_process_exits(server):
    family = server.family()
    out: dict = {}
    client = threading.Thread(target=stream_one, args=(server.url, out, 40))
    client.start()
    busy_replica(server, out)
    server.proc.send_signal(signal.SIGTERM)
    client.join(120)
    assert out.get("status") == 200 and out["lines"][-1] == "data: [DONE]", out
    final = json.loads(out["lines"][-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length", out
    assert server.proc.wait(120) == 0
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, [p.info if hasattr(p, "info") else p for p in alive]
