"""Prefixes kept in host memory past their slots: a conversation whose slot another one took gets its
entries back instead of computing them again; the tokens stay litgpt's generate_fn's and the engine's
without a store."""

from __future__ import annotations

import random

import pytest

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.prefix_store import PrefixStore

from helpers import litgpt_greedy, tiny_gpt

OUT = 5


def engine_for(gpt, store_mb: int = 64, compile: str = "eager", **overrides) -> Engine:
    config = dict(batch_size=1, max_seq_length=128, prefill_chunk=8, prefix_store_mb=store_mb, compile=compile)
    return Engine(gpt, EngineConfig(**{**config, **overrides}))


def alternating_turns(engine: Engine, turns: int = 2) -> tuple[list[list[int]], list[list[int]]]:
    """Two conversations taking turns on one slot: each turn sends its whole history and 7 new ids."""
    rng = random.Random(0)
    history, prompts, replies = [[], []], [], []
    for _ in range(turns):
        for c in (0, 1):
            prompt = history[c] + [rng.randrange(256) for _ in range(7)]
            reply = engine.generate([prompt], SamplingParams(max_new_tokens=OUT))[0].token_ids
            history[c] = prompt + reply
            prompts.append(prompt)
            replies.append(reply)
    return prompts, replies


@pytest.mark.parametrize("compile", ["eager", "thunder"])
def test_a_conversation_gets_its_entries_back_after_another_took_its_slot(compile):
    gpt = tiny_gpt("llama")
    engine, without = engine_for(gpt, compile=compile), engine_for(gpt, store_mb=0)
    prompts, replies = alternating_turns(engine)
    assert alternating_turns(without) == (prompts, replies)
    for prompt, reply in zip(prompts, replies):
        assert reply == litgpt_greedy(gpt, prompt, OUT)
    # Each second turn restores its first turn: prompt and reply but the reply's last token (never fed).
    restored = sum(len(p) + OUT - 1 for p in prompts[:2])
    assert engine.stats()["prompt_tokens_reused"] == restored
    assert without.stats()["prompt_tokens_reused"] == 0
    assert engine.stats()["prefix_store_tokens"] > 0 and without.stats()["prefix_store_tokens"] == 0
    assert set(engine.runner.saved_prefixes) == set(engine.scheduler.store.entries)


def test_an_aborted_request_is_not_stored_and_reset_or_a_failed_step_empties_the_store():
    gpt = tiny_gpt("llama")
    engine = engine_for(gpt)
    first, other = list(range(1, 30)), list(range(100, 120))
    engine.generate([first], SamplingParams(max_new_tokens=2))
    request_id = engine.add_request(other, SamplingParams(max_new_tokens=5))
    engine.step()  # `first`'s entries are saved before `other` writes over them
    engine.abort(request_id)
    assert list(engine.scheduler.store.entries.values()) == [first + litgpt_greedy(gpt, first, 1)]
    before = engine.stats()["prompt_tokens_reused"]
    assert engine.generate([other], SamplingParams(max_new_tokens=3))[0].token_ids == litgpt_greedy(gpt, other, 3)
    assert engine.stats()["prompt_tokens_reused"] == before  # nothing of the aborted request came back
    assert engine.generate([first], SamplingParams(max_new_tokens=3))[0].token_ids == litgpt_greedy(gpt, first, 3)
    assert engine.stats()["prompt_tokens_reused"] == before + len(first) - 1

    engine.generate([other], SamplingParams(max_new_tokens=2))  # `first` stored again
    engine.reset_prefix_cache()
    assert engine.stats()["prefix_store_tokens"] == 0
    assert engine.step() == []  # an idle step plans nothing: the entries to free wait for the next plan
    engine.generate([first], SamplingParams(max_new_tokens=2))
    assert engine.runner.saved_prefixes == {}  # the cleared entries were freed with the next step

    run = engine.runner.step_fn

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    engine.runner.step_fn = failing
    engine.add_request(other, SamplingParams(max_new_tokens=2), request_id="x")
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine.runner.step_fn = run
    engine.abort("x")
    assert engine.stats()["prefix_store_tokens"] == 0
    assert engine.generate([first], SamplingParams(max_new_tokens=4))[0].token_ids == litgpt_greedy(gpt, first, 4)


def test_the_store_keeps_the_longest_prefixes_it_can_hold_and_drops_the_least_recently_used():
    store = PrefixStore(capacity=10)
    a = store.add([1, 2, 3])
    assert store.add([1, 2]) is None  # covered by [1, 2, 3]
    b = store.add([1, 2, 3, 4])  # extends a: a goes
    assert store.take_dropped() == (a,) and list(store.entries) == [b] and store.tokens == 4
    c = store.add([7, 8, 9])
    store.use(b)
    d = store.add([5, 6, 5, 6])  # 11 tokens > 10: the least recently used (c) goes
    assert store.take_dropped() == (c,) and list(store.entries) == [b, d] and store.tokens == 8
    assert store.longest([1, 2, 3, 4, 5], limit=4) == (b, 4)
    assert store.longest([1, 2, 3, 4, 5], limit=2) == (b, 2)
    assert store.longest([9], limit=1) == (None, 0)
    assert store.add(list(range(11))) is None  # longer than the store
    store.clear()
    assert store.tokens == 0 and sorted(store.take_dropped()) == sorted([b, d])
