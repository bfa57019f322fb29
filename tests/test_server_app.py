"""The HTTP side of `thunder-batch serve` in process (FastAPI's TestClient on the built app, no worker
process): the key on every route but /health, X-Request-Id, 429 before anything is tokenized, 503 while
draining or when the worker serving a request died, 504 on the request timeout, /metrics, and OpenAI's
response shapes for n, logprobs and echo read by the official `openai` client from a scripted worker."""

from __future__ import annotations

import json
import os
import queue
import time

import openai
import pytest
from fastapi.testclient import TestClient
from litserve.utils import LitAPIStatus

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEAD_PID = 2**22 + 4321


class ScriptedWorker(queue.Queue):
    """LitServe's request queue, answered at once by `script(payload) -> [(message, finished)]`."""

    def __init__(self, routes, script):
        super().__init__()
        self.routes, self.script = routes, script

    def put(self, item, block=True, timeout=None):
        super().put(item)
        _, uid, _, payload = item
        buffer = self.routes.response_buffer[uid]
        for message, finished in self.script(payload):
            status = LitAPIStatus.FINISH_STREAMING if finished else LitAPIStatus.OK
            buffer.response_queue.append((message, status))
        buffer.event.set()


def make_app(tmp_path, script=lambda payload: [], **kw):
    from thunder_batch.cli.options import EngineOptions
    from thunder_batch.serve.server import build_server

    options = EngineOptions(checkpoint_dir=tmp_path / "Tiny", batch_size=2, compile="eager")
    server, state = build_server(options, api_key=KEY, max_waiting=1, **kw)
    routes = server.lit_api.spec
    routes.request_queue, routes.response_buffer, routes.response_queue_id = ScriptedWorker(routes, script), {}, 0
    state.set_worker(0, pid=os.getpid(), ready=1)
    return TestClient(server.app), state, routes


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", "max_tokens": 2, **fields}


def test_every_route_but_health_needs_the_key_and_every_answer_has_a_request_id(tmp_path):
    client, state, _ = make_app(tmp_path)
    for path in ["/docs", "/redoc", "/openapi.json", "/info", "/metrics", "/stats", "/v1/models", "/"]:
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert len(r.headers["x-request-id"]) == 32
    assert client.post("/v1/completions", json=completion()).status_code == 401
    for path in ["/docs", "/openapi.json", "/metrics", "/v1/models"]:
        assert client.get(path, headers={"X-API-Key": KEY}).status_code == 200, path
    r = client.get("/health", headers={"X-Request-Id": "abc-1"})
    assert (r.status_code, r.text, r.headers["x-request-id"]) == (200, "ok", "abc-1")
    state.set_worker(0, failed_steps=3)
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["problems"] == ["worker 0: its last 3 steps failed"]


def test_past_capacity_429_before_the_queue_and_503_while_draining(tmp_path):
    client, state, routes = make_app(tmp_path)
    state.add_in_flight(0, 2)  # capacity: 1 worker x (2 slots + 1 waiting) = 3
    r = client.post("/v1/completions", json=completion(n=2), headers=AUTH)
    assert (r.status_code, r.headers["retry-after"]) == (429, "1")
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "server_overloaded") and "3 requests" in error[
        "message"
    ]
    assert routes.request_queue.qsize() == 0  # refused before anything reached a worker
    state.start_draining()
    r = client.post("/v1/completions", json=completion(), headers=AUTH)
    assert (r.status_code, r.json()["error"]["code"], r.headers["retry-after"]) == (503, "draining", "1")
    assert client.get("/health").status_code == 503
    metrics = client.get("/metrics", headers=AUTH).text
    assert 'thunder_batch:request_rejected_total{model_name="Tiny",status="429"} 1.0' in metrics
    assert 'thunder_batch:num_requests_in_flight{model_name="Tiny"} 2' in metrics


def test_request_timeout_is_a_504_or_an_error_event_and_cancels(tmp_path):
    claimed = [({"event": "claimed", "worker": 0, "pid": os.getpid()}, False)]
    client, state, routes = make_app(tmp_path, lambda payload: claimed, request_timeout=0.3)
    start = time.monotonic()
    r = client.post("/v1/completions", json=completion(), headers=AUTH)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert 0.3 <= time.monotonic() - start < 3
    assert routes.board.pending() == 1 and state.in_flight() == 0  # the worker will free its slot
    started = [*claimed, ({"event": "accepted", "prompt_tokens": 1}, False)]
    started.append(({"event": "delta", "index": 0, "text": "A"}, False))
    client, state, routes = make_app(tmp_path, lambda payload: started, request_timeout=0.3)
    r = client.post("/v1/completions", json=completion(stream=True), headers=AUTH)
    events = [json.loads(e[6:]) if e != "data: [DONE]" else e for e in r.text.split("\n\n") if e]
    assert r.status_code == 200 and events[0]["choices"][0]["text"] == "A"  # then the deadline passes
    assert events[1]["error"]["code"] == "timeout" and events[2:] == ["data: [DONE]"]
    assert state.in_flight() == 0 and routes.board.pending() == 1


def test_a_request_whose_worker_died_gets_a_503(tmp_path):
    claimed = [({"event": "claimed", "worker": 0, "pid": DEAD_PID}, False)]
    client, state, _ = make_app(tmp_path, lambda payload: claimed)
    state.set_worker(0, pid=DEAD_PID)
    r = client.post("/v1/completions", json=completion(), headers=AUTH)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_died"
    assert state.in_flight() == 0


def scripted_answers(payload: dict) -> list:
    """Two choices per prompt: 'A' then 'B' with logprob entries, and an echoed prompt."""
    n = len(payload["prompts"]) * payload["n"]
    out = [({"event": "claimed", "worker": 0, "pid": os.getpid()}, False)]
    out.append(({"event": "accepted", "prompt_tokens": 3 * len(payload["prompts"])}, False))
    for i in range(n):
        first = {"event": "delta", "index": i, "text": "A", "logprobs": [["A", -0.5, [["A", -0.5], ["C", -1.5]]]]}
        if payload["echo"]:
            first["echo"] = {"text": "hi", "logprobs": [["h", None, None], ["i", -2.0, [["i", -2.0], ["x", -3.0]]]]}
        last = {"event": "delta", "index": i, "text": "B", "logprobs": [["B", -0.25, [["B", -0.25], ["D", -2.5]]]]}
        out += [(first, False), ({**last, "finish_reason": "length", "completion_tokens": 2}, i == n - 1)]
    return out


def test_openai_client_reads_n_logprobs_and_echo(tmp_path):
    client, state, _ = make_app(tmp_path, scripted_answers)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=client, max_retries=0)
    chat = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True, top_logprobs=2
    )
    assert [c.message.content for c in chat.choices] == ["AB", "AB"] and chat.usage.completion_tokens == 4
    content = chat.choices[1].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("A", -0.5, [65]), ("B", -0.25, [66])]
    assert [(a.token, a.logprob) for a in content[0].top_logprobs] == [("A", -0.5), ("C", -1.5)]
    done = oai.completions.create(model="m", prompt=["hi", "ho"], logprobs=1, echo=True, max_tokens=2)
    assert [c.index for c in done.choices] == [0, 1] and done.choices[0].text == "hiAB"
    lp = done.choices[0].logprobs
    assert lp.tokens == ["h", "i", "A", "B"] and lp.token_logprobs == [None, -2.0, -0.5, -0.25]
    assert (
        lp.text_offset == [0, 1, 2, 3] and lp.top_logprobs[0] is None and lp.top_logprobs[2] == {"A": -0.5, "C": -1.5}
    )
    assert done.usage.prompt_tokens == 6  # each prompt once
    chunks = list(oai.completions.create(model="m", prompt="hi", n=2, stream=True, logprobs=1, max_tokens=2))
    assert sorted((c.choices[0].index, c.choices[0].text) for c in chunks) == [(0, "A"), (0, "B"), (1, "A"), (1, "B")]
    assert [c.choices[0].finish_reason for c in chunks] == [None, "length", None, "length"]
    assert chunks[1].choices[0].logprobs.text_offset == [1] and state.in_flight() == 0


@pytest.mark.parametrize(
    "host, warned", [("127.0.0.1", False), ("::1", False), ("localhost", False), ("0.0.0.0", True)]
)
def test_binding_beyond_loopback_without_a_key_warns(host, warned):
    from thunder_batch.cli.serve import _loopback

    assert _loopback(host) is not warned
