"""Structured output: 50 varied JSON schemas all validate, constrained greedy is litgpt's masked argmax, a constrained
row beside free rows equals it alone, compiled == eager with no new step shape, regex / choice / grammars hold, and
bad schemas are refused by name before any step."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint
from thunder_batch.config import ParamError

from helpers import ENGINE_CONFIG, tiny_gpt

CONFIG = dict(batch_size=8, max_seq_length=384, prefill_chunk=32)
NAME = {"type": "string", "maxLength": 16}
FIELDS = [
    ("name", NAME),
    ("age", {"type": "integer", "minimum": 0, "maximum": 120}),
    ("score", {"type": "number", "minimum": 0, "maximum": 10}),
    ("active", {"type": "boolean"}),
    ("color", {"enum": ["red", "green", "blue"]}),
    ("tags", {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}),
    ("ids", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 99}, "minItems": 1, "maxItems": 4}),
    ("size", {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 50}, {"enum": ["small", "large"]}]}),
    (
        "owner",
        {
            "type": "object",
            "properties": {"name": NAME, "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
            "required": ["name", "id"],
            "additionalProperties": False,
        },
    ),  # every field bounded: open objects, strings or integers let a small model run on until max_tokens
    ("note", {"type": ["string", "null"], "maxLength": 12}),
]


def schemas() -> list[dict]:
    """50 object schemas: 1 to 4 fields each, some optional, no extra properties; every 7th nested in a list."""
    out = []
    for i in range(50):
        picked = [FIELDS[(i * 3 + k * 7) % len(FIELDS)] for k in range(1 + i % 4)]
        props = dict(picked)
        required = [name for k, (name, _) in enumerate(picked) if (i + k) % 3 != 0] or [picked[0][0]]
        schema = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
        if i % 7 == 6:
            schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 2}
        out.append(schema)
    return out


@pytest.fixture(scope="module")
def engine():
    return Engine.from_checkpoint(default_checkpoint_dir(), EngineConfig(compile="eager", **CONFIG))


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with JSON only. {what}"}]


@pytest.mark.slow
def test_fifty_json_schemas_all_validate(engine):
    cases = schemas()
    params = [SamplingParams(max_new_tokens=200, json_schema=s) for s in cases]
    prompts = [ask(f"Describe item number {i} of a shop.") for i in range(len(cases))]
    for schema, result in zip(cases, engine.generate(prompts, params)):
        assert result.finish_reason == "stop", (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


def masked_greedy(gpt, tokenizer, prompt: list[int], kind: str, text: str, eos: int, max_new: int):
    """The oracle: litgpt's uncached forward, argmax over the tokens a fresh llguidance matcher allows (EOS once
    it accepts), one token at a time -> (tokens, each one's logprob under the mask)."""
    import llguidance as llg
    import llguidance.numpy as lnp
    import numpy as np

    from thunder_batch.constraints import JSON_STYLE

    lt = llg.LLTokenizer(tokenizer.processor.to_str(), eos_token=eos)
    grammar = llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_STYLE) if kind == "json_schema" else None
    matcher = llg.LLMatcher(lt, grammar or llg.grammar_from(kind, text))
    mask, out, logprobs = lnp.allocate_token_bitmask(1, lt.vocab_size), [], []
    with torch.no_grad():
        while len(out) < max_new:
            logits = gpt(torch.tensor([prompt + out]))[0, -1].float()
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: logits.shape[0]].astype(bool)
            allowed[eos] |= matcher.is_accepting()
            masked = torch.where(torch.from_numpy(allowed), logits, -torch.inf)
            out.append(int(masked.argmax()))
            logprobs.append(float(torch.log_softmax(masked, -1)[out[-1]]))
            if out[-1] == eos:
                break
            assert matcher.consume_token(out[-1])
    return out, logprobs


@pytest.mark.slow
def test_constrained_greedy_is_the_masked_argmax_and_leaves_free_rows_alone(engine):
    gpt, tokenizer, _ = load_checkpoint(default_checkpoint_dir())
    schema = {"type": "object", "properties": {"city": NAME, "people": {"type": "integer"}}, "required": ["city"]}
    cases = [
        ("json_schema", json.dumps(schema, sort_keys=True), SamplingParams(max_new_tokens=40, json_schema=schema)),
        ("regex", r"[0-9]{3}-[0-9]{4}", SamplingParams(max_new_tokens=40, regex=r"[0-9]{3}-[0-9]{4}")),
        ("choice", '["yes", "no", "maybe"]', SamplingParams(max_new_tokens=40, choice=["yes", "no", "maybe"])),
    ]
    prompts = [ask("Which city is the largest in France?"), ask("A phone number:"), ask("Is the sea blue?")]
    free = SamplingParams(max_new_tokens=12)
    batch = engine.generate([*prompts, *prompts], [p for _, _, p in cases] + [free] * 3)
    eos = min(engine.eos_ids)
    for (kind, text, _), prompt, result in zip(cases, prompts, batch):
        ids = engine.encode(prompt)
        want, logprobs = masked_greedy(gpt, tokenizer, ids, kind, text, eos, 40)
        assert result.token_ids + ([eos] if result.finish_reason == "stop" else []) == want, kind
        assert result.logprobs == pytest.approx(logprobs[: len(result.logprobs)], abs=1e-4)  # the masked distribution
    alone = engine.generate(prompts, free)
    assert [r.token_ids for r in batch[3:]] == [r.token_ids for r in alone]
    assert [r.token_ids for r in batch[:3]] == [r.token_ids for r in engine.generate(prompts, [p for *_, p in cases])]


@pytest.mark.slow
def test_regex_choice_and_grammars_hold(engine):
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    lark = 'start: "Colour: " COLOUR\nCOLOUR: "red" | "green"'
    params = [
        SamplingParams(max_new_tokens=30, regex=r"[A-Z][a-z]+ [0-9]{2}"),
        SamplingParams(max_new_tokens=30, choice=["Paris", "Lyon"]),
        SamplingParams(max_new_tokens=30, grammar=gbnf),
        SamplingParams(max_new_tokens=30, grammar=lark),
        SamplingParams(max_new_tokens=200, json_schema={"type": "object"}),
    ]
    prompts = [
        ask("A name and an age."),
        ask("The capital of France?"),
        ask("Is 2 even?"),
        ask("A colour?"),
        ask("A user record."),
    ]
    results = engine.generate(prompts, params)
    texts = [r.text for r in results]
    assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", texts[0]) and texts[1] in ("Paris", "Lyon")
    assert texts[2] in ("The answer is yes.", "The answer is no.") and texts[3] in ("Colour: red", "Colour: green")
    assert results[4].finish_reason == "stop" and isinstance(json.loads(texts[4]), dict)


@pytest.mark.slow
def test_forced_tokens_give_the_tokens_of_one_step_each_in_fewer_steps():
    """Tokens the grammar alone allows are appended unsampled and fed at once: the same tokens (greedy and seeded,
    beside free rows), logprobs (0 where forced; others within a prefill row's rounding), in fewer steps."""
    from thunder_batch.tool_calls import tool_grammar, tool_prompt

    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    prompts = [ask(f"Describe item number {i} of a shop.") for i in range(5)]
    prompts += [tool_prompt([{"role": "user", "content": "Add 2 and 3."}], [tool]), ask("Say hi.")]
    params = [SamplingParams(max_new_tokens=150, json_schema=s, logprobs=2) for s in schemas()[:3]]
    params += [
        SamplingParams(max_new_tokens=150, json_schema=s, temperature=0.9, seed=i) for i, s in enumerate(schemas()[3:5])
    ]
    params += [
        SamplingParams(max_new_tokens=60, grammar=tool_grammar([tool], "required")),
        SamplingParams(max_new_tokens=20),
    ]
    forcing, one_each = (
        Engine.from_checkpoint(default_checkpoint_dir(), EngineConfig(compile="eager", forced_tokens=f, **CONFIG))
        for f in (True, False)
    )
    forced, plain = forcing.generate(prompts, params), one_each.generate(prompts, params)
    steps = [e.stats()["steps"] for e in (forcing, one_each)]
    for a, b in zip(forced, plain):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
    assert 0.0 in forced[0].logprobs and steps[0] < 0.75 * steps[1], steps


def test_forced_tokens_below_the_least_asked_are_not_taken_and_the_gate_weighs_measured_steps():
    import numpy as np
    from litgpt import Tokenizer

    from thunder_batch.constraints import GrammarCompiler, normalize_constraint
    from thunder_batch.forced import ForcedTokensGate

    tokenizer = Tokenizer(default_checkpoint_dir())
    compiler = GrammarCompiler(tokenizer, tokenizer.eos_id, 49152)
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}
    params = SamplingParams(json_schema=dict(schema, additionalProperties=False))
    kind, text = normalize_constraint(params)
    one, two = (compiler.constraint(kind, text, {tokenizer.eos_id}) for _ in range(2))
    start = tokenizer.encode("{", bos=False).tolist()
    assert one.forced(start, limit=50, least=99) == [] and one.taken == len(start)  # rolled back: nothing taken
    fresh, rows = compiler.constraint(kind, text, {tokenizer.eos_id}), np.zeros((2, 49152 // 32), dtype=np.int32)
    fresh.advance(start)
    one.fill(rows[0]), fresh.fill(rows[1])
    assert (rows[0] == rows[1]).all() and rows[0].any()  # the mask of the state before them, as a fresh one's
    forced = one.forced(start, limit=50)
    assert forced == two.forced(start, limit=50) and len(forced) >= 3  # the key's tokens, as from a fresh state
    assert tokenizer.decode(torch.tensor(start + forced)).startswith('{"population":')
    gate = ForcedTokensGate()
    for lanes, seconds in [(0, 9.0), (1, 9.0), (0, 0.02), (1, 0.06)]:  # the first of each kind is not counted
        gate.record(lanes, seconds)
    assert gate.least(1, running=1) == 2 and gate.least(1, running=8) == 16  # B + k >= r B with r = 3
    assert ForcedTokensGate().least(1, running=1) is None  # nothing measured: sample one step each


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(json_schema={"type": "foo"}), "json_schema", "foo"),
        (dict(json_schema={"type": "array", "uniqueItems": True}), "json_schema", "uniqueItems"),
        (dict(regex="(("), "regex", "unclosed"),
        (dict(grammar="root ::= (("), "grammar", "grammar"),
    ],
)
def test_a_bad_schema_or_grammar_is_refused_by_name_before_any_step(engine, fields, param, words):
    with pytest.raises(ParamError, match=words) as e:
        engine.prepare("hi", SamplingParams(**fields))
    assert e.value.param == param and not engine.has_unfinished()


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(json_schema="{not json"), "json_schema"),
        (dict(json_schema=[1]), "json_schema"),
        (dict(regex=""), "regex"),
        (dict(choice=[]), "choice"),
        (dict(choice=["a", 3]), "choice"),
        (dict(regex="a", choice=["a"]), "choice"),
    ],
)
def test_malformed_constraints_are_refused_by_sampling_params(fields, param):
    with pytest.raises(ParamError) as e:
        SamplingParams(**fields)
    assert e.value.param == param


def test_compiled_constrained_steps_equal_eager_and_make_no_new_shape():
    """A tiny random model with the real tokenizer's vocabulary: its JSON is nonsense but follows the schema."""
    _, tokenizer, _ = load_checkpoint(default_checkpoint_dir())
    gpt = tiny_gpt("llama", vocab_size=49152, padded_vocab_size=49152)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}}
    params = [
        SamplingParams(max_new_tokens=16, json_schema=schema),
        SamplingParams(max_new_tokens=16, choice=["alpha", "beta"], temperature=1.0, seed=3),
        SamplingParams(max_new_tokens=16),
        SamplingParams(max_new_tokens=16, regex="[a-c]+", logit_bias={64: 5.0}),
    ]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    config = dict(ENGINE_CONFIG, forced_tokens=True)  # both feed the same steps (the gate weighs each one's times)
    engines = [Engine(gpt, EngineConfig(compile=mode, **config), tokenizer) for mode in ("thunder", "eager")]
    engines[0].generate(prompts, SamplingParams(max_new_tokens=16))  # the step shapes this traffic takes
    misses = engines[0].stats()["cache_misses"]
    got, want = (e.generate(prompts, params) for e in engines)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert engines[0].stats()["cache_misses"] == misses
    assert got[1].text in ("alpha", "beta") and re.fullmatch("[a-c]+", got[3].text)
