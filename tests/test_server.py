"""`thunder-batch serve`: OpenAI request parsing and the worker side on a tiny model (fast), then a
real server process on 127.0.0.1 with the real default model (eager, marked slow), driven by the
official `openai` client and checked against the engine's offline greedy results."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from thunder_batch.config import SamplingParams
from thunder_batch.serve.openai import CHAT, COMPLETION, APIError, Limits, parse_request

from live_server import KEY, ROOT, Server

# The server's and the offline oracle's; forced tokens always (the default gate weighs each engine's own step times)
ENGINE = dict(batch_size=8, max_seq_length=128, prefill_chunk=8, forced_tokens=True)
MODEL = "SmolLM2-135M-Instruct"
LONG = "Count to fifty: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # a prompt greedy decoding continues past 30 tokens


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# -- parsing (no server) ---------------------------------------------------------------------
def test_parse_chat_defaults_and_text_parts():
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    job = parse_request(body(model="anything", messages=[{"role": "user", "content": parts}]), CHAT)
    assert job.prompts == [[{"role": "user", "content": "Hi there"}]]
    # OpenAI's defaults: temperature 1, and a chat reply may fill the rest of the context (None)
    defaults = SamplingParams(max_new_tokens=None, temperature=1.0, top_p=1.0, top_k=None, stop=None, seed=None)
    assert job.params == defaults
    assert (job.stream, job.include_usage) == (False, False)


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("abc", ["abc"]),
        (["abc"], ["abc"]),
        ([1, 2], [[1, 2]]),
        ([[4, 5]], [[4, 5]]),
        (["a", [3], "b"], ["a", [3], "b"]),
    ],
)
def test_parse_completion_prompt_forms(prompt, expected):
    job = parse_request(body(prompt=prompt), COMPLETION, Limits(max_n=1, max_choices=3))
    assert job.prompts == expected and job.params.max_new_tokens == 16  # OpenAI's completions default


def test_parse_n_logprobs_and_echo():
    limits = Limits(max_n=4, max_choices=8)
    chat = parse_request(
        body(messages=[{"role": "user", "content": "hi"}], n=3, logprobs=True, top_logprobs=5), CHAT, limits
    )
    assert (chat.n, chat.choices, chat.logprobs, chat.params.logprobs, chat.params.prompt_logprobs) == (
        3,
        3,
        True,
        5,
        None,
    )
    plain = parse_request(body(messages=[{"role": "user", "content": "hi"}], logprobs=True), CHAT, limits)
    assert (plain.logprobs, plain.params.logprobs) == (True, 0)  # the sampled token's logprob, no alternatives
    done = parse_request(body(prompt=["a", "b"], n=2, logprobs=2, echo=True), COMPLETION, limits)
    assert (done.choices, done.echo, done.params.logprobs, done.params.prompt_logprobs) == (4, True, 2, 2)
    echo_only = parse_request(body(prompt="a", echo=True), COMPLETION, limits)
    assert (echo_only.echo, echo_only.logprobs, echo_only.params.prompt_logprobs) == (True, False, None)


def test_parse_completion_sampling_and_stream_options():
    raw = body(
        prompt="x",
        max_tokens=5,
        temperature=0,
        top_p=0.5,
        top_k=-1,
        stop=".",
        seed=3,
        n=1,
        stream=True,
        stream_options={"include_usage": True},
        presence_penalty=0.5,
        frequency_penalty=-1,
        logit_bias={"7": -100, "12": 2.5},
        repetition_penalty=1.1,
        min_p=0.05,
        min_tokens=2,
        user="u",
    )
    job = parse_request(raw, COMPLETION)
    controls = dict(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.1, min_p=0.05, min_tokens=2)
    want = SamplingParams(max_new_tokens=5, temperature=0, top_p=0.5, stop=".", seed=3, logit_bias={7: -100, 12: 2.5})
    assert job.params == dataclasses.replace(want, **controls)
    assert job.stream and job.include_usage


def test_parse_structured_output_fields():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    cases = [
        (dict(response_format={"type": "json_object"}), ("json_schema", '{"type": "object"}')),
        (dict(response_format=wrapped), ("json_schema", json.dumps(schema, sort_keys=True))),
        (dict(guided_json=schema), ("json_schema", json.dumps(schema, sort_keys=True))),
        (dict(guided_regex="[0-9]+"), ("regex", "[0-9]+")),
        (dict(guided_choice=["a", "b"]), ("choice", '["a", "b"]')),
        (dict(grammar='root ::= "x"'), ("grammar", 'root ::= "x"')),
        (dict(response_format={"type": "text"}), None),
    ]
    for fields, want in cases:
        assert (
            parse_request(body(messages=[{"role": "user", "content": "hi"}], **fields), CHAT).params.constraint == want
        )
        assert parse_request(body(prompt="x", **fields), COMPLETION).params.constraint == want


BAD = [  # (kind, raw body, code, param)
    (CHAT, b"{not json", "invalid_json", None),
    (CHAT, b"[1, 2]", "invalid_json", None),
    (CHAT, b"\xff\xfe{}", "invalid_json", None),
    (CHAT, body(model="m"), "invalid_value", "messages"),
    (CHAT, body(messages="hi"), "invalid_type", "messages"),
    (CHAT, body(messages=[{"role": "user", "content": {"x": 1}}]), "invalid_type", "messages"),
    (
        CHAT,
        body(messages=[{"role": "user", "content": "hi"}], presence_penalty=2.5),
        "invalid_value",
        "presence_penalty",
    ),
    (COMPLETION, body(prompt="x", frequency_penalty="high"), "invalid_type", "frequency_penalty"),
    (COMPLETION, body(prompt="x", logit_bias={"x": 1}), "invalid_value", "logit_bias"),
    (COMPLETION, body(prompt="x", logit_bias={"3": 150}), "invalid_value", "logit_bias"),
    (COMPLETION, body(prompt="x", logit_bias=[1]), "invalid_type", "logit_bias"),
    (COMPLETION, body(prompt="x", min_p=2), "invalid_value", "min_p"),
    (COMPLETION, body(prompt="x", max_tokens=3, min_tokens=4), "invalid_value", "min_tokens"),
    (COMPLETION, body(prompt="x", response_format={"type": "xml"}), "invalid_value", "response_format"),
    (COMPLETION, body(prompt="x", response_format={"type": "json_schema"}), "invalid_value", "response_format"),
    (COMPLETION, body(prompt="x", guided_regex="a", guided_choice=["a"]), "invalid_value", "guided_choice"),
    (COMPLETION, body(prompt="x", guided_json="{not json"), "invalid_value", "guided_json"),
    (COMPLETION, body(prompt="x", guided_choice=[]), "invalid_value", "guided_choice"),
    (COMPLETION, body(prompt=""), "invalid_value", "prompt"),
    (COMPLETION, body(prompt=["a", ""]), "invalid_value", "prompt"),
    (COMPLETION, body(prompt=[]), "invalid_value", "prompt"),
    (COMPLETION, body(prompt=["a", "b", "c"]), "invalid_value", "prompt"),  # 3 answers, the limit is 2
    (COMPLETION, body(prompt="x", logprobs=21), "invalid_value", "logprobs"),
    (COMPLETION, body(prompt="x", logprobs=True), "invalid_type", "logprobs"),
    (COMPLETION, body(prompt="x", echo="yes"), "invalid_type", "echo"),
    (CHAT, body(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "invalid_value", "top_logprobs"),
    (
        CHAT,
        body(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=-1),
        "invalid_value",
        "top_logprobs",
    ),
    (CHAT, body(messages=[{"role": "user", "content": "hi"}], best_of=2), "unsupported", "best_of"),
    (COMPLETION, body(prompt="x", model=3), "invalid_type", "model"),
    (COMPLETION, body(prompt="x", temperature="hot"), "invalid_type", "temperature"),
    (COMPLETION, b'{"prompt": "x", "temperature": NaN}', "invalid_type", "temperature"),
    (COMPLETION, body(prompt="x", max_tokens=1.5), "invalid_type", "max_tokens"),
    (COMPLETION, body(prompt="x", max_tokens=True), "invalid_type", "max_tokens"),
    (COMPLETION, body(prompt="x", stream="yes"), "invalid_type", "stream"),
    (COMPLETION, body(prompt="x", stop=[1, 2]), "invalid_type", "stop"),
    (COMPLETION, body(prompt="x", stop=[""]), "invalid_value", "stop"),
    (COMPLETION, body(prompt="x", temperature=-1), "invalid_value", "temperature"),
    (COMPLETION, body(prompt="x", top_p=0), "invalid_value", "top_p"),
    (COMPLETION, body(prompt="x", top_k=-5), "invalid_value", "top_k"),
    (COMPLETION, body(prompt="x", max_tokens=0), "invalid_value", "max_tokens"),
    (COMPLETION, body(prompt="x", seed=-1), "invalid_value", "seed"),
    (COMPLETION, body(prompt="x", n=3), "invalid_value", "n"),  # more than the batch size (2 here)
    (COMPLETION, body(prompt="x", n=0), "invalid_value", "n"),
    (COMPLETION, b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", "invalid_json", None),  # past the recursion limit
]


@pytest.mark.parametrize("kind, raw, code, param", BAD)
def test_parse_rejects_with_openai_error(kind, raw, code, param):
    with pytest.raises(APIError) as info:
        parse_request(raw, kind, Limits(max_n=2, max_choices=2))
    error = info.value.body()["error"]
    assert info.value.status == 400
    assert error == {"message": error["message"], "type": "invalid_request_error", "param": param, "code": code}
    assert "max_new_tokens" not in error["message"]  # engine names never leak: the client sent max_tokens


# -- a real server ---------------------------------------------------------------------------
real_model = pytest.mark.slow  # the real model in a server process: ~2-4 min for all of these here


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    from thunder_batch.checkpoints import default_checkpoint_dir

    return default_checkpoint_dir(ROOT / "checkpoints")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    args = [f"--{k}={v}" for k, v in ENGINE.items()]
    srv = Server(tmp_path_factory.mktemp("server") / "server.log", checkpoint, *args, "--api_key", KEY)
    yield srv
    if srv.proc.poll() is None:  # the last test stops it itself
        srv.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """prompts, max_tokens[, stop] -> the engine's own greedy GenerationResults, run in this process."""
    import torch

    from thunder_batch import Engine, EngineConfig, SamplingParams

    engine = Engine.from_checkpoint(checkpoint, EngineConfig(compile="eager", **ENGINE))

    def expect(prompts: list, max_tokens: int, stop=None, **params):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return engine.generate(prompts, SamplingParams(max_new_tokens=max_tokens, stop=stop, **params))
        finally:
            torch.set_num_threads(threads)

    expect.engine = engine
    return expect


@pytest.fixture(scope="module")
def logits_oracle(checkpoint):
    """token ids -> log_softmax of litgpt's own forward pass of the real model, in fp32: [T, V]."""
    import torch

    from thunder_batch.checkpoints import load_checkpoint

    gpt, tokenizer, _ = load_checkpoint(checkpoint, dtype=torch.float32)

    def oracle(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(gpt(torch.tensor([ids]))[0].float(), dim=-1)

    oracle.tokenizer = tokenizer
    return oracle


def in_parallel(*calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


@real_model
def test_health_and_models(server):
    assert httpx.get(server.url + "/health").text == "ok"  # open without the key, for load balancers
    assert [m.id for m in server.client().models.list().data] == [MODEL]


@real_model
def test_completion_equals_offline_greedy(server, offline):
    prompt = "The capital of France is"
    [want] = offline([prompt], 8)
    reply = server.client().completions.create(model="any name", prompt=prompt, max_tokens=8, temperature=0)
    assert (reply.object, reply.model) == ("text_completion", MODEL)
    assert reply.choices[0].text == want.text and reply.choices[0].finish_reason == want.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(want.prompt_ids), 8)
    assert reply.usage.total_tokens == len(want.prompt_ids) + 8


@real_model
def test_completion_stream_stops_at_stop_string(server, offline):
    prompt = "The capital of France is"
    [want] = offline([prompt], 8, stop=["."])
    assert want.finish_reason == "stop" and "." not in want.text
    [whole] = offline([prompt], len(want.token_ids) + 1)
    assert whole.text == want.text + "." and whole.token_ids[:-1] == want.token_ids  # the '.' token is not counted
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stop=["."],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_ids)


@real_model
def test_chat_stream_and_not_equal_offline(server, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [want] = offline([messages], 6)
    client = server.client()
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    full, chunks = in_parallel(
        lambda: client.chat.completions.create(**kw), lambda: list(client.chat.completions.create(**kw, stream=True))
    )
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want.text and full.choices[0].finish_reason == want.finish_reason
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(want.prompt_ids), len(want.token_ids))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


@real_model
def test_penalties_and_logit_bias_reach_the_sampler(server, offline):
    """OpenAI's fields and vLLM's extras give the engine's own tokens for the same controls, which differ from
    the free run's."""
    prompt = "List the days of the week: Monday, Tuesday,"
    controls = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"11": 5})
    extras = dict(repetition_penalty=1.3, min_tokens=4)
    [free] = offline([prompt], 10)
    [want] = offline(
        [prompt], 10, logit_bias={11: 5}, **{k: v for k, v in controls.items() if k != "logit_bias"}, **extras
    )
    reply = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, **controls, extra_body=extras
    )
    assert reply.choices[0].text == want.text != free.text


@real_model
def test_structured_output_through_the_openai_client(server, offline):
    """`chat.completions.parse` with a pydantic model, json_object streamed, vLLM's guided_choice, and a schema the
    engine cannot compile refused with 400 naming the problem."""
    import pydantic
    from openai.lib._pydantic import to_strict_json_schema

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    client = server.client()
    messages = [{"role": "user", "content": "Give the largest city of France as JSON."}]
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, max_tokens=80, temperature=0
    )
    [want] = offline([messages], 80, json_schema=to_strict_json_schema(City))  # the schema the client sends
    assert parsed.choices[0].message.content == want.text and parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].message.parsed == City.model_validate_json(want.text)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=80,  # the server's slots hold 128 tokens; the prompt takes 39
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in stream)), dict)
    choice = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, extra_body={"guided_choice": ["blue", "green"]}
    )
    assert choice.choices[0].text in ("blue", "green")
    bad = server.post(
        "/v1/completions",
        body(
            prompt="x",
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "foo"}}},
        ),
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    assert "foo" in bad.json()["error"]["message"]


@real_model
def test_seed_top_k_top_p_reach_the_sampler(server, offline):
    prompt = "Once upon a time"
    [greedy] = offline([prompt], 6)
    client = server.client()

    def text(**kw) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **kw).choices[0].text

    seeded_a, seeded_b, other_seed, top_k_1, tiny_top_p = in_parallel(
        lambda: text(temperature=1.5, seed=7),
        lambda: text(temperature=1.5, seed=7),
        lambda: text(temperature=1.5, seed=7 + 2**40),  # differs only above bit 31
        lambda: text(temperature=1.5, extra_body={"top_k": 1}),
        lambda: text(temperature=1.5, top_p=1e-6),
    )
    [alone] = offline([prompt], 6, temperature=1.5, seed=7)
    assert seeded_a == seeded_b == alone.text  # the same seed gives the same text, whatever the batch
    assert other_seed != seeded_a
    assert top_k_1 == tiny_top_p == greedy.text


@real_model
def test_logprobs_equal_log_softmax_of_the_eager_model(server, offline, logits_oracle):
    """Completions with echo and logprobs, and chat with top_logprobs, against litgpt's own forward."""
    import torch

    client, prompt = server.client(), "The capital of France is"
    [want] = offline([prompt], 4)
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3, echo=True)
    choice, ids = reply.choices[0], want.prompt_ids + want.token_ids  # the text's own tokens: no BOS added
    assert choice.text == prompt + want.text and reply.usage.total_tokens == len(ids)
    full = logits_oracle(ids)  # [T, V]
    lp = choice.logprobs  # one entry per token, each scored given all before it; the first has nothing before it
    assert "".join(lp.tokens) == choice.text and lp.text_offset == [
        len("".join(lp.tokens[:i])) for i in range(len(ids))
    ]
    assert (lp.token_logprobs[0], lp.top_logprobs[0]) == (None, None)
    want_lp = full[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want_lp, atol=1e-3)
    best = full[:-1].topk(3, dim=-1)
    decode = logits_oracle.tokenizer.processor.decode
    for t, (alts, values) in enumerate(zip(best.indices.tolist(), best.values.tolist())):
        expect = {decode([i], skip_special_tokens=False): v for i, v in zip(alts, values)}
        got = lp.top_logprobs[t + 1]  # the 3 alternatives and the token itself
        assert set(expect) <= set(got) and all(abs(got[k] - v) < 1e-3 for k, v in expect.items()), t

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    [want] = offline([messages], 3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(want.token_ids) == 3
    full = logits_oracle(want.prompt_ids + want.token_ids)[len(want.prompt_ids) - 1 : -1]  # [3, V]
    for entry, row, token in zip(content, full, want.token_ids):
        assert abs(entry.logprob - row[token].item()) < 1e-3 and len(entry.top_logprobs) == 2
        assert [abs(a.logprob - v) < 1e-3 for a, v in zip(entry.top_logprobs, row.topk(2).values.tolist())] == [
            True
        ] * 2
    assert "".join(e.token for e in content) == chat.choices[0].message.content == want.text


@real_model
def test_n_and_several_prompts_are_each_the_request_alone(server, offline):
    client = server.client()
    prompts = ["The capital of France is", "Once upon a time"]
    wants = offline(prompts, 5)
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.text for c in reply.choices] == [w.text for w in wants]
    assert reply.usage.prompt_tokens == sum(len(w.prompt_ids) for w in wants)
    sampled = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=1.2, seed=3, n=3, logprobs=0
    )
    texts = [c.text for c in sampled.choices]
    [alone] = offline([prompts[1]], 6, temperature=1.2, seed=3)
    assert texts[0] == alone.text and len(set(texts)) == 3  # choice 0 is the request alone; each its own stream
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in sampled.choices)
    too_many = server.post("/v1/completions", body(prompt="x", n=ENGINE["batch_size"] + 1))
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


@real_model
def test_metrics_count_what_the_server_did(server):
    server.client().completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=3, temperature=0)
    text = server.metrics()

    def value(name: str, **labels: str) -> float:
        """The sample `name` with exactly these labels (besides model_name), whatever their order."""
        want = {"model_name": MODEL, **labels}
        for line in text.splitlines():
            head, _, number = line.rpartition(" ")
            if head.startswith(f"thunder_batch:{name}{{"):
                found = dict(kv.split("=", 1) for kv in head[len(name) + 15 : -1].split(","))
                if {k: v.strip('"') for k, v in found.items()} == want:
                    return float(number)
        raise AssertionError(f"no {name}{want} in /metrics")

    assert value("generation_tokens_total") >= 3 and value("prompt_tokens_total") > 0
    assert value("request_success_total", finished_reason="length") >= 1
    assert value("time_to_first_token_seconds_count") >= 1 and value("inter_token_latency_seconds_count") >= 2
    assert value("num_requests_running") == 0 and value("kv_cache_usage_perc") == 0
    assert value("num_slots") == ENGINE["batch_size"] and value("worker_healthy", worker="0") == 1
    stream = iter(
        server.client().completions.create(model=MODEL, prompt=LONG, max_tokens=30, temperature=0, stream=True)
    )
    next(stream)  # sent after the step that made it, which reported the gauges
    text = server.metrics()
    entries = value("kv_cache_usage_perc") * ENGINE["batch_size"] * ENGINE["max_seq_length"]  # the one request's
    assert value("num_requests_running") == 1 and len(LONG.split()) <= round(entries) <= ENGINE["max_seq_length"]
    assert list(stream)[-1].choices[0].finish_reason == "length"
    assert "thunder_batch:step_duration_seconds_bucket{" in text and "decode rows, attend" in text


@real_model
def test_example_client(server, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    [want] = offline([messages], 4)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "openai_client.py"),
            "--base-url",
            server.url + "/v1",
            "--api-key",
            KEY,
            "--max-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0] == f"model: {MODEL}"
    assert lines[1].startswith(f"chat: {want.text!r} (finish_reason={want.finish_reason}")
    assert lines[2].startswith("stream: Once upon a time") and len(lines[2]) > len("stream: Once upon a time")


HTTP_BAD = [  # (path, raw body, status, code, param): the last four are caught by the worker's tokenizer
    ("/v1/chat/completions", b"{oops", 400, "invalid_json", None),
    ("/v1/completions", body(model=MODEL), 400, "invalid_value", "prompt"),
    ("/v1/completions", body(prompt="hi", temperature="hot"), 400, "invalid_type", "temperature"),
    ("/v1/completions", body(prompt="hi", top_p=1.5), 400, "invalid_value", "top_p"),
    ("/v1/completions", b" " * 1_000_001, 413, "request_too_large", None),
    ("/v1/completions", body(prompt="word " * 200), 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", body(prompt="hi", max_tokens=200), 400, "context_length_exceeded", "max_tokens"),
    ("/v1/completions", body(prompt=[10**9]), 400, "invalid_value", "prompt"),
    ("/v1/chat/completions", body(messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_value", "messages"),
]


@real_model
def test_bad_input_gets_4xx_and_others_keep_going(server, offline):
    prompt = "The capital of France is"
    [want] = offline([prompt], 8)
    client = server.client()

    def good() -> str:
        return "".join(
            c.choices[0].text
            for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        )

    def bad() -> list:
        return in_parallel(*[lambda path=path, raw=raw: server.post(path, raw) for path, raw, *_ in HTTP_BAD])

    text, responses = in_parallel(good, bad)
    assert text == want.text  # a request in flight is undisturbed by the rejected ones
    for (path, _, status, code, param), r in zip(HTTP_BAD, responses):
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), error
        assert error["message"]
    assert server.wait_all_free()["free_slots"] == ENGINE["batch_size"]


@real_model
def test_api_key(server):
    for headers in [{}, {"Authorization": "Bearer wrong"}]:
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.post("/v1/completions", body(prompt="hi"), key=None).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.url + "/v1/models", headers={"X-API-Key": KEY}).status_code == 200


@real_model
def test_disconnect_aborts_and_frees_slots(server):
    client = server.client()
    before = server.stats()["generated_tokens"]

    def start_stream(i: int):
        stream = client.completions.create(
            model=MODEL, prompt=f"Count to a hundred: {i},", max_tokens=100, temperature=0, stream=True
        )
        next(iter(stream))  # it is generating
        return stream

    streams = in_parallel(*[lambda i=i: start_stream(i) for i in range(ENGINE["batch_size"])])
    for stream in streams:
        stream.close()  # hang up mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up waiting
        server.post("/v1/completions", body(prompt="Count: 1,", max_tokens=100, temperature=0), timeout=3)
    stats = server.wait_all_free(timeout=60)
    assert stats["free_slots"] == ENGINE["batch_size"]
    # Nine requests asked for 900 tokens; the hang-ups stopped them long before.
    assert stats["generated_tokens"] - before < 300


@real_model
def test_16_clients_100_requests(server, offline):
    max_tokens = 6
    texts = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Water boils at", "My favourite colour is"]
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]
        for q in ("Name a fruit.", "What is 2+2?")
    ]
    wants = offline(texts + chats, max_tokens)
    client = server.client()

    def run(i: int):
        k = i % len(wants)
        prompt, stream = (texts + chats)[k], i % 2 == 1
        if k < len(texts):
            kw = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream)
            if not stream:
                r = client.completions.create(**kw)
                return k, r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
            chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            return k, text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens
        kw = dict(model=MODEL, messages=prompt, max_tokens=max_tokens, temperature=0, stream=stream)
        if not stream:
            r = client.chat.completions.create(**kw)
            return k, r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        chunks = list(client.chat.completions.create(**kw, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return k, text, chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(100)))
    for k, text, finish_reason, completion_tokens in results:
        want = wants[k]
        assert (text, finish_reason, completion_tokens) == (want.text, want.finish_reason, len(want.token_ids)), k
    stats = server.wait_all_free(timeout=10)
    assert stats["free_slots"] == ENGINE["batch_size"] and stats["finished_requests"] >= 100


@real_model
def test_deeply_nested_body_is_a_400_on_a_connection_that_stays_usable(server):
    deep = b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}"  # past Python's recursion limit in json.loads
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:  # one kept-alive connection
        r = client.post("/v1/completions", content=deep)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert r.headers.get("connection") != "close"
        again = client.post("/v1/completions", json=dict(prompt="hi", max_tokens=1, temperature=0))
        assert again.status_code == 200 and again.json()["object"] == "text_completion", again.text


@real_model
def test_an_idle_server_rests_and_sigterm_stops_every_process(server):
    """Runs last: it stops the shared server."""
    main = psutil.Process(server.proc.pid)
    family = [main, *main.children(recursive=True)]
    assert len(family) >= 4  # main, HTTP server, inference worker, queue managers
    listening = {tuple(c.laddr) for c in main.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert listening == {("127.0.0.1", server.port)}  # the default host: this machine only
    server.wait_all_free()

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in family if p.is_running())

    time.sleep(1)
    start = cpu_seconds()
    time.sleep(10)
    # ~0.03-0.04 CPU-s per 10 s here, half of it uvicorn's own tick (benchmarks/idle_server.py); polling
    # LitServe's queue every 5 ms cost 0.85, a spinning loop ~10.
    assert cpu_seconds() - start < 0.1, "an idle server must rest"
    # SIGTERM drains: the stream in flight runs to its end, a new request gets 503, then everything stops.
    chunks = iter(
        server.client().completions.create(
            model=MODEL, prompt="Count to fifty: 1, 2,", max_tokens=40, temperature=0, stream=True
        )
    )
    first = next(chunks)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    refused = server.post("/v1/completions", body(prompt="hi", max_tokens=1))
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "draining")
    assert server.health().status_code == 503
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason in ("length", "stop") and first.choices[0].finish_reason is None
    assert server.proc.wait(60) == 0
    _, alive = psutil.wait_procs(family[1:], timeout=15)
    assert not alive, [p.cmdline() for p in alive]
