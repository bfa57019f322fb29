"""Tool calls: the Hermes / Qwen2.5 prompt of a whole tool conversation, the grammars per tool_choice (checked token
by token with llguidance on the real tokenizer), reading calls back (whole and streamed), the request fields'
errors, and a live server whose `tool_calls` (whole, streamed, and through `chat.completions.parse`) equal the
engine's own constrained greedy answer read back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from thunder_batch.chat import apply_chat
from thunder_batch.config import ParamError
from thunder_batch.serve.openai import CHAT, APIError, parse_request
from thunder_batch.tool_calls import check_tools, parse_tool_calls, streamable, tool_grammar, tool_prompt

from live_server import KEY, Server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": dict(name="get_weather", description="Weather in a city", parameters=WEATHER)},
    {"type": "function", "function": dict(name="add", description="Add two integers", parameters=ADD)},
]
NAMES = ("get_weather", "add")
SCHEMAS = dict(get_weather=WEATHER, add=ADD)


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- the prompt, the grammars, reading calls back (no model) -------------------------------------------------
def test_a_tool_conversation_renders_as_hermes_chatml():
    from litgpt.prompts import ChatML

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2 and 3+4?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "7"},
    ]
    text = apply_chat(ChatML(), tool_prompt(messages, TOOLS))
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n") and f"<tools>\n{tools}\n</tools>" in text
    two_calls = f"{call_text('add', {'a': 1, 'b': 2})}\n{call_text('add', {'a': 1, 'b': 2})}"
    assert text.endswith(
        f"<|im_start|>user\n1+2 and 3+4?<|im_end|>\n<|im_start|>assistant\n{two_calls}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tool_prompt(messages[:2], None) == messages[:2]  # no tools: the messages as they are
    with pytest.raises(ParamError, match="arguments are not JSON"):
        tool_prompt([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], None)


@pytest.mark.parametrize(
    "tools, choice, param, words",
    [
        ([{"type": "function"}], "auto", "tools", "must be a list"),
        ([{"type": "function", "function": {"name": "a b"}}], "auto", "tools", "1-64 letters"),
        (TOOLS + TOOLS[:1], "auto", "tools", "unique"),
        (TOOLS, "sometimes", "tool_choice", "one of"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "name one of"),
    ],
)
def test_bad_tools_are_refused_by_name(tools, choice, param, words):
    with pytest.raises(ParamError, match=words) as e:
        check_tools(tools, choice)
    assert e.value.param == param


@pytest.fixture(scope="module")
def matcher():
    """grammar, text -> whether llguidance takes the text's tokens and then accepts (the real model's tokenizer)."""
    import llguidance
    from litgpt import Tokenizer

    from thunder_batch.checkpoints import default_checkpoint_dir

    tokenizer = Tokenizer(default_checkpoint_dir())
    lltok = llguidance.LLTokenizer(tokenizer.processor.to_str(), eos_token=tokenizer.eos_id)

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar), log_level=0)
        return all(m.consume_token(t) for t in tokenizer.encode(text, bos=False).tolist()) and m.is_accepting()

    return accepts


def test_each_tool_choice_grammar_takes_its_answers_only(matcher):
    paris, add = call_text("get_weather", {"city": "Paris"}), call_text("add", {"a": 2, "b": 3})
    required, auto = tool_grammar(TOOLS, "required"), tool_grammar(TOOLS, "auto")
    assert matcher(required, paris) and matcher(required, f"{paris}\n{add}")
    assert not matcher(required, "It is sunny.")  # required: calls only
    assert not matcher(required, call_text("get_weather", {"town": "Paris"}))  # arguments follow the schema
    assert not matcher(required, call_text("get_weather", {"city": "Paris", "extra": 1}))
    assert not matcher(required, call_text("mail", {}))  # only the tools' names
    assert not matcher(tool_grammar(TOOLS, "required", parallel=False), f"{paris}\n{add}")
    assert matcher(tool_grammar(TOOLS, "add"), add) and not matcher(tool_grammar(TOOLS, "add"), paris)
    assert matcher(auto, "It is sunny.") and matcher(auto, f"Let me look.\n{paris}")  # auto: text, then calls
    assert not matcher(auto, call_text("get_weather", {"town": "Paris"}))  # a call it starts must be valid
    assert tool_grammar(TOOLS, "none") is None


def test_calls_are_read_back_and_invalid_blocks_stay_content():
    paris = call_text("get_weather", {"city": "Paris"})
    content, calls = parse_tool_calls(f"Let me look.\n{paris}\n{call_text('add', {'a': 1, 'b': 2})}", NAMES)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    for bad in (call_text("mail", {}), "<tool_call>\n{not json\n</tool_call>", call_text("add", {})[:-5]):
        assert parse_tool_calls(f" a {bad} ", NAMES) == (f"a {bad}", [])  # unknown, broken, unfinished
    assert parse_tool_calls("  ", NAMES) == (None, [])


def test_streamed_content_only_grows_and_ends_as_the_whole_answers_content():
    text = "  Let me look. <tool_c" + call_text("add", {"a": 1, "b": 2})[7:] + " done"
    sent = ""
    for end in range(len(text) + 1):
        now = streamable(text[:end])
        assert now.startswith(sent) and "<" not in now
        sent = now
    assert sent == "Let me look." == parse_tool_calls(text, NAMES)[0][: len(sent)]


# -- the request's fields (no server) ----------------------------------------------------------------------
def chat(**fields) -> bytes:
    return json.dumps(dict(messages=[{"role": "user", "content": "Weather in Paris?"}], **fields)).encode()


def test_tools_parse_into_the_prompt_and_the_grammar():
    job = parse_request(chat(tools=TOOLS, tool_choice="required"), CHAT)
    assert job.tool_names == NAMES and job.params.grammar == tool_grammar(TOOLS, "required")
    assert job.prompts == [tool_prompt([{"role": "user", "content": "Weather in Paris?"}], TOOLS)]
    none = parse_request(chat(tools=TOOLS, tool_choice="none"), CHAT)
    assert none.tool_names == () and none.params.grammar is None and len(none.prompts[0]) == 1
    assert parse_request(chat(tools=TOOLS), CHAT).params.grammar == tool_grammar(TOOLS, "auto")  # OpenAI's default


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=[{"type": "code_interpreter"}]), "tools"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), "tool_choice"),
        (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format"),
        (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        parse_request(chat(**fields), CHAT)
    assert e.value.status == 400 and e.value.param == param


# -- the real model: the engine's answer, and a live server's ---------------------------------------------
# forced_tokens pinned: the server's and the oracle's engines must feed the same steps (the default gate weighs
# each engine's own step times), and the server's forced tokens are then exercised too
ENGINE = dict(batch_size=2, max_seq_length=512, prefill_chunk=32, forced_tokens=True)
ASKS = ["What is the weather in Paris?", "Add 12 and 30.", "Is it raining in Tokyo in celsius?"]


@pytest.fixture(scope="module")
def offline():
    from thunder_batch import Engine, EngineConfig, SamplingParams
    from thunder_batch.checkpoints import default_checkpoint_dir

    engine = Engine.from_checkpoint(default_checkpoint_dir(), EngineConfig(compile="eager", **ENGINE))

    def answer(messages: list[dict], choice: str) -> str:
        params = SamplingParams(max_new_tokens=120, grammar=tool_grammar(TOOLS, choice))
        return engine.generate([tool_prompt(messages, TOOLS)], params)[0]

    return answer


@pytest.mark.slow
def test_required_calls_from_the_model_are_valid_calls(offline):
    for ask in ASKS:
        result = offline([{"role": "user", "content": ask}], "required")
        content, calls = parse_tool_calls(result.text, NAMES)
        assert result.finish_reason == "stop" and content is None and calls, result.text
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from thunder_batch.checkpoints import default_checkpoint_dir

    args = [f"--{k}={v}" for k, v in ENGINE.items()]
    srv = Server(tmp_path_factory.mktemp("tools") / "server.log", default_checkpoint_dir(), *args, "--api_key", KEY)
    yield srv
    srv.stop()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.slow
def test_a_live_server_answers_tool_calls_whole_streamed_and_parsed(server, offline):
    client, messages = server.client(), [{"role": "user", "content": ASKS[0]}]
    reply = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120
    )
    want = parse_tool_calls(offline(messages, "required").text, NAMES)[1]
    expected = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]
    assert reply.choices[0].finish_reason == "tool_calls" and calls_of(reply.choices[0].message) == expected
    assert reply.choices[0].message.content is None and reply.choices[0].message.tool_calls[0].id.startswith("call_")
    with client.chat.completions.stream(
        model="m", messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and calls_of(final.choices[0].message) == expected
    # The call's result goes back in, and the model answers in words (tool_choice "none": no tools in the prompt).
    follow = [*messages, reply.choices[0].message.model_dump(exclude_none=True)]
    follow.append({"role": "tool", "tool_call_id": reply.choices[0].message.tool_calls[0].id, "content": "22 C"})
    words = client.chat.completions.create(model="m", messages=follow, tools=TOOLS, temperature=0, max_tokens=40)
    assert words.choices[0].message.content and words.choices[0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_pydantic_tools_parse_through_the_openai_client(server):
    import openai
    import pydantic

    class Weather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=20)

    parsed = server.client().chat.completions.parse(
        model="m",
        messages=[{"role": "user", "content": ASKS[0]}],
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        temperature=0,
        max_tokens=80,
    )
    [call] = parsed.choices[0].message.tool_calls
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)
    broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]  # no such JSON type
    bad = server.post("/v1/chat/completions", chat(tools=broken, max_tokens=1))
    error = bad.json()["error"]
    assert bad.status_code == 400 and error["param"] == "tools" and "foo" in error["message"]
