"""Stop strings cut tokens as well as text: a stop string's tokens are neither in `token_ids` nor
counted; a token whose text begins before the stop string stays (its text up to the stop is
returned); streamed token ids are exactly the final ones. String stops without a tokenizer are refused."""

from __future__ import annotations

import functools

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from thunder_batch.config import ParamError, SamplingParams
from thunder_batch.detokenize import IncrementalDetokenizer
from thunder_batch.request import STOP, Request

CORPUS = ["The capital of France is Paris. The capital of Italy is Rome.", "Paris, Rome. Berlin!"] * 20


@functools.cache
def tokenizer() -> Tokenizer:
    """A small byte-level BPE: whole words and '.' are single tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def ids(text: str) -> list[int]:
    return tokenizer().encode(text).ids


def run(tokens: list[int], stop, max_new_tokens: int = 50) -> tuple[Request, list[int], str]:
    """Feed `tokens` one by one as sampled tokens; (the request, streamed token ids, streamed text)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=stop)
    request = Request(0, ids("The capital of France is"), params, 0, frozenset(), IncrementalDetokenizer(tokenizer()))
    streamed, text = [], ""
    for t in tokens:
        out = request.append(t, -float(t), [(t, -1.0)])
        streamed += out.token_ids
        text += out.text
        assert len(out.logprobs) == len(out.token_ids)
        if request.finished:
            break
    return request, streamed, text


def test_a_stop_string_token_is_not_returned_nor_counted():
    tokens = ids(" Paris. The capital")
    assert [tokenizer().decode([t]) for t in tokens[:2]] == [" Paris", "."]  # '.' is its own token
    request, streamed, text = run(tokens, ".")
    result = request.result()
    assert (result.text, result.finish_reason) == (text, STOP) == (" Paris", STOP)
    assert result.token_ids == streamed == tokens[:1]  # the '.' token is gone
    assert result.logprobs == [-float(tokens[0])]


def test_a_token_that_straddles_the_stop_string_is_kept():
    tokens = ids(" Paris, Rome")
    assert tokenizer().decode([tokens[0]]) == " Paris"
    request, streamed, text = run(tokens, "is,")  # the stop begins inside " Paris" and ends in ","
    result = request.result()
    assert result.text == text == " Par"
    assert result.token_ids == streamed == tokens[:1]  # " Paris" began before the stop: kept; "," dropped


def test_stop_string_spanning_tokens_releases_them_only_once_safe():
    tokens = ids(" Paris. The capital of Italy")
    request, streamed, text = run(tokens, ". The cap")
    result = request.result()
    assert result.text == text == " Paris"
    assert result.token_ids == streamed == tokens[:1]


def test_a_stop_string_at_the_very_start_leaves_nothing():
    tokens = ids(". Paris")
    request, streamed, text = run(tokens, ".")
    assert (request.result().token_ids, streamed, text) == ([], [], "")


def test_without_a_stop_every_token_and_its_text_come_out():
    tokens = ids(" Paris. The capital")
    request, streamed, text = run(tokens, None, max_new_tokens=len(tokens))
    assert request.result().token_ids == streamed == tokens
    assert text == " Paris. The capital"


def test_string_stops_without_a_tokenizer_are_refused():
    with pytest.raises(ParamError, match="need a tokenizer") as info:
        Request(0, [1, 2], SamplingParams(stop=["."]), 0)
    assert info.value.param == "stop"
    Request(0, [1, 2], SamplingParams(stop=[[5, 6]]), 0)  # token-id stops need none
