"""An engine replica of `serve --replicas` (serve/replicas.py) without Ray, on a tiny model: concurrent
requests each get the engine's offline answer, an abandoned stream frees its slot, bad requests end in
their error, and an idle replica's step task sleeps."""

from __future__ import annotations

import asyncio

from test_server_worker import greedy, payload, tiny_api

from thunder_batch.serve.replicas import EngineReplica

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14]]


async def collect(replica: EngineReplica, body: dict) -> list[dict]:
    return [message async for message, _ in replica.generate(body)]


def offline_tokens(prompts, max_tokens: int) -> list[list[int]]:
    engine = tiny_api().engine
    return [r.token_ids for r in engine.generate(prompts, greedy(max_tokens))]


def test_concurrent_requests_get_their_offline_tokens():
    replica = EngineReplica(tiny_api())  # 2 slots: 4 requests queue for them

    async def run():
        return await asyncio.gather(*(collect(replica, payload(p, params=greedy(6))) for p in PROMPTS))

    answers = asyncio.run(run())
    for messages in answers:
        assert messages[0] == {"event": "accepted", "prompt_tokens": messages[0]["prompt_tokens"]}
        assert messages[-1]["finish_reason"] == "length" and messages[-1]["completion_tokens"] == 6
    prompt_tokens = [m[0]["prompt_tokens"] for m in answers]
    assert prompt_tokens == [len(p) for p in PROMPTS]
    # the tiny model has no tokenizer: its deltas carry no text, so compare the engine's own record
    stats = replica.stats()
    assert stats["ready"] == 1 and stats["running"] == 0 and stats["finished_requests"] == len(PROMPTS)


def test_answers_equal_the_offline_engine_token_for_token():
    replica = EngineReplica(tiny_api())
    seen = []

    async def run():
        return await asyncio.gather(*(collect(replica, payload(p, params=greedy(5), logprobs=True)) for p in PROMPTS))

    for messages in asyncio.run(run()):
        seen.append([entry[0] for m in messages[1:] for entry in m.get("logprobs", [])])
    expected = [[f"<{t}>" for t in ids] for ids in offline_tokens(PROMPTS, 5)]  # no tokenizer: "<id>"
    assert seen == expected


def test_an_abandoned_stream_frees_its_slot_and_the_others_finish():
    replica = EngineReplica(tiny_api())

    async def run():
        stream = replica.generate(payload([1, 2, 3], params=greedy(20)))
        first = [await anext(stream) for _ in range(2)]  # accepted, then a token
        await stream.aclose()  # the client hung up
        rest = await collect(replica, payload([4, 5], params=greedy(3)))
        for _ in range(100):
            if not replica.api.has_active_requests():
                break
            await asyncio.sleep(0.01)
        return first, rest

    first, rest = asyncio.run(run())
    assert first[0][0]["event"] == "accepted" and first[1][0]["event"] == "delta"
    assert rest[-1]["completion_tokens"] == 3
    assert replica.api.engine.counters()["running"] == 0
    assert replica.api.board.pending() == 0  # the cancel was claimed by the step that aborted it


def test_a_bad_request_ends_in_its_error_and_an_idle_replica_sleeps():
    replica = EngineReplica(tiny_api())

    async def run():
        bad = await collect(replica, payload([1] * 40, params=greedy(4)))  # past max_seq_length 32
        good = await collect(replica, payload([1, 2], params=greedy(2)))
        steps = replica.api.engine.stats()["steps"]
        await asyncio.sleep(0.3)
        return bad, good, replica.api.engine.stats()["steps"] - steps, replica._steps

    bad, good, idle_steps, task = asyncio.run(run())
    assert bad == [{"event": "error", "error": bad[0]["error"]}]
    assert bad[0]["error"]["status"] == 400 and bad[0]["error"]["code"] == "context_length_exceeded"
    assert good[-1]["completion_tokens"] == 2
    assert idle_steps == 0 and task is not None


def test_an_idle_replica_reads_a_burst_in_one_first_step():
    """Requests sent at once (each admitted a little after the other) share the first step, as a LitServe
    worker's intake gathers them: without the gather the first would step alone."""
    replica = EngineReplica(tiny_api())
    fed = []
    replica.api.engine.observers.add(lambda event: fed.append(len(event.plan.work)))

    async def run():
        async def late(delay: float, prompt):
            await asyncio.sleep(delay)
            return await collect(replica, payload(prompt, params=greedy(2)))

        return await asyncio.gather(late(0, [1, 2, 3, 4, 5, 6]), late(0.003, [7, 8, 9, 10, 11, 12]))

    answers = asyncio.run(run())
    assert [a[-1]["completion_tokens"] for a in answers] == [2, 2]
    assert fed[0] == 2, fed  # both slots fed in the first step


def test_metrics_of_replicas_merge_with_the_ingress_s_own_each_family_declared_once():
    from prometheus_client.parser import text_string_to_metric_families

    from thunder_batch.serve.metrics import Metrics, merge_replicas

    ingress, replicas = Metrics("m"), {"a": EngineReplica(tiny_api()), "b": EngineReplica(tiny_api())}
    ingress.labels(ingress.request_success, finished_reason="stop").inc()
    replicas["a"].api.metrics.labels(replicas["a"].api.metrics.generation_tokens).inc(5)
    text = merge_replicas(ingress.render().decode(), {k: r.metrics_text() for k, r in replicas.items()}).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["thunder_batch:request_success_total", (("finished_reason", "stop"), ("model_name", "m"))] == 1
    assert samples["thunder_batch:generation_tokens_total", (("model_name", "tiny"), ("replica", "a"))] == 5
    assert samples["thunder_batch:num_slots", (("model_name", "tiny"), ("replica", "b"))] == 2
