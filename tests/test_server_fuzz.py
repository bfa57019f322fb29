"""No input that hurts the batch or the worker: generated JSON bodies (a valid request with some fields
replaced by adversarial values, or anything at all) thrown at parsing (a ParsedRequest or an APIError, nothing
else) and at a live tiny server (never a 5xx, and the server still answers a plain request the same
way afterwards). Every sampling field is bounded at parse time; stops are bounded and stored in
memory linear in their length."""

from __future__ import annotations

import json
import tracemalloc

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thunder_batch.config import MAX_STOP_LENGTH, SamplingParams
from thunder_batch.serve.openai import CHAT, COMPLETION, APIError, Limits, parse_request

from live_server import KEY, ROOT, Server, cut_checkpoint

LIMITS = Limits(max_n=2, max_choices=4)
HUGE = [10**20, -(10**20), 10**400, 2**63, 2**63 - 1, -(2**63) - 1, 1e308, -1e308, 5e-324, 1e-45]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
    "stop", "seed", "logprobs", "top_logprobs", "echo", "stream", "stream_options", "best_of", "suffix",
    "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "user", "guided_json", "guided_regex",
    "guided_choice", "grammar", "repetition_penalty", "min_p", "min_tokens",
]  # fmt: skip
BASE = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0},
    COMPLETION: {"model": "m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0},
}
adversarial = st.one_of(
    json_values,
    st.sampled_from(["x" * 20_000, ["y" * 5000] * 2, [[1, 2]] * 100, list(range(5000)), [{"type": "text"}]]),
)


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from([CHAT, COMPLETION]))
    if draw(st.integers(0, 9)) == 0:  # anything at all
        return kind, json.dumps(draw(json_values)).encode()
    body = dict(BASE[kind])
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body[field] = draw(adversarial)
    return kind, json.dumps(body).encode()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_parsing_answers_a_job_or_a_4xx(case):
    kind, raw = case
    try:
        job = parse_request(raw, kind, LIMITS)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message
        return
    assert isinstance(job.params, SamplingParams) and 1 <= job.choices <= LIMITS.max_choices


@pytest.mark.parametrize(
    "field, value",
    [("top_k", 10**20), ("temperature", 10**400), ("temperature", 1e308), ("max_tokens", 10**30), ("seed", 2**64)],
)
def test_numbers_that_do_not_fit_are_400s_naming_the_field(field, value):
    with pytest.raises(APIError) as info:
        parse_request(json.dumps(dict(BASE[COMPLETION], **{field: value})).encode(), COMPLETION)
    assert info.value.status == 400 and info.value.param == field


def test_a_long_stop_is_refused_and_an_allowed_one_costs_linear_memory():
    with pytest.raises(APIError) as info:
        parse_request(json.dumps(dict(BASE[COMPLETION], stop="x" * 20_000, n=2)).encode(), COMPLETION, LIMITS)
    assert info.value.status == 400 and info.value.param == "stop" and str(MAX_STOP_LENGTH) in info.value.message
    from thunder_batch.request import Request

    params = SamplingParams(stop=["ab" * (MAX_STOP_LENGTH // 2)] * 1)
    tracemalloc.start()
    requests = [Request(i, [1, 2], params, 0, frozenset(), detokenizer=object()) for i in range(2)]
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(requests) == 2 and size < 2 * 40 * MAX_STOP_LENGTH  # every prefix would be ~8 MB per request


# -- a live tiny server ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from thunder_batch.checkpoints import default_checkpoint_dir

    checkpoint = cut_checkpoint(default_checkpoint_dir(ROOT / "checkpoints"), tmp_path_factory.mktemp("ckpt"), 1)
    args = ["--batch_size=2", "--max_seq_length=48", "--prefill_chunk=8", "--api_key", KEY, "--max_waiting=2"]
    srv = Server(tmp_path_factory.mktemp("server") / "server.log", checkpoint, *args)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_a_live_server_answers_generated_bodies_without_a_5xx(server):
    plain = json.dumps(BASE[COMPLETION]).encode()
    before = server.post("/v1/completions", plain).json()["choices"][0]["text"]
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies())
    def throw(case):
        kind, raw = case
        path = "/v1/chat/completions" if kind == CHAT else "/v1/completions"
        with httpx.stream("POST", server.url + path, content=raw, headers={"Authorization": f"Bearer {KEY}"}) as r:
            r.read()  # a stream's error arrives as an event: read every byte of it
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (raw[:300], r.text[:300])
            assert b'"server_error"' not in r.content, (raw[:300], r.text[:300])

    throw()
    assert server.post("/v1/completions", plain).json()["choices"][0]["text"] == before
    assert statuses.get(200) and any(400 <= s < 500 for s in statuses), statuses
    assert server.health().status_code == 200
