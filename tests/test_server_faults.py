"""Faults on live tiny servers (the default model cut to one layer, eager): a stopped worker (SIGSTOP) is
found by its missing heartbeat, its request answered 503 and the worker restarted; with two workers, one
lost leaves /health 200 "degraded" naming it, none serving is 503; SIGTERM to the whole process group
drains (the stream in flight ends whole) and every process exits; with nothing in flight every process
exits within seconds of SIGTERM to the main process; `--host localhost` and an IPv6 address serve."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from live_server import KEY, ROOT, Server, cut_checkpoint

ARGS = ["--batch_size=2", "--max_seq_length=64", "--prefill_chunk=8", "--api_key", KEY]
HEADERS = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from thunder_batch.checkpoints import default_checkpoint_dir

    return cut_checkpoint(default_checkpoint_dir(ROOT / "checkpoints"), tmp_path_factory.mktemp("ckpt"), 1)


def workers(server: Server) -> list[dict]:
    return server.stats()["workers"]


def exited_within(processes: list[psutil.Process], seconds: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=seconds)
    return not alive


def test_a_stopped_worker_is_found_by_its_heartbeat_answered_and_restarted(checkpoint, tmp_path):
    """Its stream in flight gets a 503 error event; a request sent after it stopped waits in LitServe's queue
    and is served by the replacement."""
    server = Server(tmp_path / "stop.log", checkpoint, *ARGS, "--worker_timeout=3")
    try:
        expected = server.post("/v1/completions", json.dumps(BODY).encode()).json()["choices"][0]["text"]
        [worker] = workers(server)
        out, later = {}, {}
        client = threading.Thread(target=stream_one, args=(server.url, out, 60))
        client.start()
        deadline = time.monotonic() + 30
        while not out.get("first"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(worker["pid"], signal.SIGSTOP)
        start = time.monotonic()
        time.sleep(0.5)  # past the worker's last pending get on LitServe's queue (loop.TAKE_WAIT_S)
        queued = threading.Thread(
            target=lambda: later.update(r=server.post("/v1/completions", json.dumps(BODY).encode()))
        )
        queued.start()
        client.join(60)
        error = json.loads(out["lines"][-2].removeprefix("data: "))
        assert error["error"]["code"] == "worker_died" and out["lines"][-1] == "data: [DONE]", out
        assert time.monotonic() - start < 15  # 3 s of silence, then the kill and the HTTP side's next check
        assert not psutil.pid_exists(worker["pid"]) or psutil.Process(worker["pid"]).status() == "zombie"
        queued.join(120)
        assert later["r"].status_code == 200 and later["r"].json()["choices"][0]["text"] == expected
        server.wait_healthy(timeout=120)
        assert workers(server)[0]["pid"] != worker["pid"]  # LitServe started a new one
    finally:
        server.stop()


def test_health_is_degraded_while_one_of_two_workers_serves(checkpoint, tmp_path):
    server = Server(tmp_path / "two.log", checkpoint, *ARGS, "--workers_per_device=2", "--worker_timeout=60")
    try:
        victim = workers(server)[0]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (health := server.health()).text == "ok":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert any(f"worker {victim['index']}" in p for p in health.json()["problems"])
        r = server.post("/v1/completions", json.dumps(BODY).encode())  # the other worker serves meanwhile
        assert r.status_code == 200, r.text
        server.wait_healthy(timeout=120)
    finally:
        server.stop()


def stream_one(url: str, out: dict, max_tokens: int = 40) -> None:
    body = dict(BODY, max_tokens=max_tokens, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
        out["status"], out["lines"] = r.status_code, []
        for line in r.iter_lines():
            if line:
                out["lines"].append(line)
                out["first"] = True


def test_sigterm_to_the_process_group_drains_the_stream_in_flight(checkpoint, tmp_path):
    server = Server(tmp_path / "group.log", checkpoint, *ARGS)
    family = server.family()
    out: dict = {}
    client = threading.Thread(target=stream_one, args=(server.url, out))
    client.start()
    deadline = time.monotonic() + 30
    while not server.stats()["in_flight"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for process in family:  # every process of the server at once, as SIGTERM to its process group does
        process.send_signal(signal.SIGTERM)
    client.join(120)
    assert out.get("status") == 200 and out["lines"][-1] == "data: [DONE]", out
    final = json.loads(out["lines"][-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length", out  # every token came, no error event
    assert server.proc.wait(60) == 0 and exited_within(family, 30), server.log()


def test_sigterm_with_nothing_in_flight_stops_every_process_within_seconds(checkpoint, tmp_path):
    server = Server(tmp_path / "idle.log", checkpoint, *ARGS)
    family = server.family()
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert exited_within(family, 15) and server.proc.wait(1) == 0, server.log()
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_host_localhost_and_ipv6_serve(checkpoint, tmp_path, host):
    server = Server(tmp_path / "host.log", checkpoint, *ARGS, host=host)
    try:
        r = httpx.post(server.url + "/v1/completions", json=BODY, headers=HEADERS, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()
