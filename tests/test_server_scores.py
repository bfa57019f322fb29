"""Scores equal to the model's: raw text is tokenized as Hugging Face's tokenizer for the checkpoint does
(transformers' AutoTokenizer is the oracle), and a server's echoed prompt logprobs equal transformers'
log_softmax of the same weights on the same text (OpenAI/vLLM echo: every prompt token, the first
with logprob null, `max_tokens: 0` allowed, an EOS in the text kept)."""

from __future__ import annotations

import json
import shutil

import pytest

from live_server import KEY, ROOT, Server, cut_checkpoint

TEXTS = [
    "The capital of France is",
    "Hello world",
    " leading space, then 2024 digits",
    "<|im_start|>user\nHi<|im_end|>",  # special tokens written in the text stay whole
    "Ends with the end token<|im_end|>",  # ... and a trailing EOS is kept (litgpt's encode drops it)
    "日本語 😀 café",
]


@pytest.fixture(scope="module")
def checkpoint():
    from thunder_batch.checkpoints import default_checkpoint_dir

    return default_checkpoint_dir(ROOT / "checkpoints")


def test_text_is_encoded_as_transformers_encodes_it(checkpoint):
    from transformers import AutoTokenizer

    from thunder_batch import Engine, EngineConfig

    hf = AutoTokenizer.from_pretrained(checkpoint)
    engine = Engine.from_checkpoint(checkpoint, EngineConfig(batch_size=1, max_seq_length=64, compile="eager"))
    for text in TEXTS:
        assert engine.encode(text) == hf(text)["input_ids"], text
    assert engine.encode("Hi")[0] != engine.tokenizer.bos_id  # litgpt's Tokenizer would force <|im_start|> here
    messages = [{"role": "user", "content": "Hi"}]  # chat keeps its template: the same ids as transformers' own
    assert engine.encode(messages) == hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


def test_add_bos_token_true_puts_one_bos_in_front(checkpoint, tmp_path):
    """tokenizer_config.json's add_bos_token: true (slow tokenizers and Llama's fast one) adds the BOS the
    post-processor does not; the text's own tokens follow unchanged."""
    from thunder_batch.checkpoints import load_checkpoint
    from thunder_batch.text_encoding import TextEncoder

    _, tokenizer, _ = load_checkpoint(checkpoint)
    plain = tokenizer.text_encoder
    copy = tmp_path / checkpoint.name
    copy.mkdir()
    shutil.copy(checkpoint / "tokenizer.json", copy / "tokenizer.json")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=True)))
    with_bos = TextEncoder.for_checkpoint(copy, tokenizer)
    for text in TEXTS:
        assert with_bos.encode(text) == [tokenizer.bos_id, *plain.encode(text)]


# -- a live server against transformers on the same weights ------------------------------------
@pytest.fixture(scope="module")
def two_layer(checkpoint, tmp_path_factory):
    return cut_checkpoint(checkpoint, tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def transformers_model(two_layer):
    """text -> (token ids, log_softmax [T, V]) by transformers' own tokenizer and model on the same fp32 weights."""
    import torch
    from transformers import AutoTokenizer

    from thunder_batch.bench.hf_transformers import to_transformers
    from thunder_batch.checkpoints import load_checkpoint

    gpt, _, _ = load_checkpoint(two_layer, dtype=torch.float32)
    model, hf_tokenizer = to_transformers(gpt), AutoTokenizer.from_pretrained(two_layer)

    def score(text: str):
        ids = hf_tokenizer(text)["input_ids"]
        with torch.no_grad():
            return ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    score.tokenizer = hf_tokenizer
    return score


@pytest.fixture(scope="module")
def server(two_layer, tmp_path_factory):
    args = ["--batch_size=4", "--max_seq_length=64", "--prefill_chunk=8", "--api_key", KEY]
    srv = Server(tmp_path_factory.mktemp("server") / "server.log", two_layer, *args)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_echoed_prompt_logprobs_equal_transformers(server, transformers_model):
    client = server.client()
    for text in TEXTS:
        ids, full = transformers_model(text)
        reply = client.completions.create(model="m", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
        choice = reply.choices[0]
        assert (choice.text, choice.finish_reason) == (text, "length")
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
        lp = choice.logprobs
        tokens = [transformers_model.tokenizer.decode([i]) for i in ids]
        assert lp.tokens == tokens and (lp.token_logprobs[0], lp.top_logprobs[0]) == (None, None), text
        want = [full[t - 1, ids[t]].item() for t in range(1, len(ids))]
        assert all(abs(a - b) < 1e-3 for a, b in zip(lp.token_logprobs[1:], want, strict=True)), (text, lp, want)
        best = [full[t - 1].max().item() for t in range(1, len(ids))]
        assert all(abs(max(top.values()) - b) < 1e-3 for top, b in zip(lp.top_logprobs[1:], best)), text


@pytest.mark.slow
def test_echo_with_max_tokens_zero_streams_the_prompt_alone(server):
    stream = server.client().completions.create(
        model="m", prompt="The capital of France is", max_tokens=0, echo=True, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == "The capital of France is"
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(Exception) as refused:  # without echo, 0 tokens asks for nothing: a 400
        server.client().completions.create(model="m", prompt="x", max_tokens=0)
    assert getattr(refused.value, "status_code", None) == 400
