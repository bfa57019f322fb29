"""Incremental detokenization against a full decode, with real tokenizers trained offline."""

import functools
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from thunder_batch.detokenize import IncrementalDetokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]
CORPUS = [
    "héllo wörld, café naïve résumé",
    "日本語のテキストです。日本は島国",
    "emoji 😀🎉 👍🏽 fun 🚀 time",
    "the quick brown fox jumps over the lazy dog",
    "Ελληνικά и русский текст",
]
TEXTS = [
    "hello world",
    " leading space and  double  spaces",
    "café naïve",
    "日本語のテキスト",
    "emoji 😀🎉 👍🏽!",
    "mixed: the 日本 fox 🚀 résumé\nnew line",
    "Ελληνικά 😀 и русский",
]


@functools.cache
def byte_level_bpe():
    """GPT-2 style byte-level BPE; few merges, so non-ASCII characters span several tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return tok


@functools.cache
def metaspace_bpe():
    """Llama-2 style: Metaspace pre-tokenizer, byte fallback, decoder strips one leading space."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
    # An ASCII alphabet: every other character goes through byte fallback. Exactly as many as
    # limit_alphabet keeps, as ties in its frequency cut are broken at random.
    alphabet = [chr(c) for c in range(32, 127)] + ["▁", "\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS + byte_tokens,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    # The trainer makes byte tokens special (decode skips them); in Llama they are plain vocab.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIALS]
    return Tokenizer.from_str(json.dumps(spec))


class ListDecoder:
    """Only ``decode(list[int])``, like a sentencepiece processor: forces the Python fallback."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


@pytest.fixture
def bytelevel():
    return byte_level_bpe()


@pytest.fixture
def metaspace():
    return metaspace_bpe()


BUILDERS = {"bytelevel": byte_level_bpe, "metaspace": metaspace_bpe}


def stream(tokenizer, ids, prompt_ids=()):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.push(i) for i in ids]
    tail = detok.flush()
    return deltas, tail


def wrappers(tok):
    """The same tokenizer seen through each supported interface."""
    return {
        "tokenizers": tok,
        "litgpt-like hf": SimpleNamespace(backend="huggingface", processor=tok),
        "fallback": ListDecoder(tok),
        "litgpt-like sentencepiece": SimpleNamespace(backend="sentencepiece", processor=ListDecoder(tok)),
    }


def test_fixture_splits_characters_across_tokens(bytelevel, metaspace):
    # Otherwise the tests below would not exercise held-back partial characters.
    for tok in (bytelevel, metaspace):
        ids = tok.encode("日本語 😀").ids
        assert any("\ufffd" in tok.decode([i]) for i in ids)
        assert len(ids) > len("日本語 😀")


@pytest.mark.parametrize("which", ["tokenizers", "litgpt-like hf", "fallback", "litgpt-like sentencepiece"])
@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_every_prefix_matches_full_decode(kind, which):
    tok = BUILDERS[kind]()
    wrapped = wrappers(tok)[which]
    for text in TEXTS:
        ids = tok.encode(text).ids
        text = tok.decode(ids)  # Metaspace drops a leading space on the round trip
        for n in range(len(ids) + 1):
            deltas, tail = stream(wrapped, ids[:n])
            assert not any("\ufffd" in d for d in deltas), (text, n, deltas)
            assert text.startswith("".join(deltas))
            expected = tok.decode(ids[:n])
            # Byte fallback turns a whole cut byte run into U+FFFD (see IncrementalDetokenizer).
            if kind == "bytelevel" or not expected.endswith("\ufffd"):
                assert "".join(deltas) + tail == expected, (text, n)
        deltas, tail = stream(wrapped, ids)
        assert tail == ""  # a complete text leaves nothing held back


@pytest.mark.parametrize("which", ["tokenizers", "fallback"])
def test_special_tokens_are_skipped_like_decode(bytelevel, which):
    eos, bos = bytelevel.token_to_id("</s>"), bytelevel.token_to_id("<s>")
    ids = [bos, *bytelevel.encode("日本 ok").ids, eos, *bytelevel.encode(" 😀").ids, eos]
    deltas, tail = stream(wrappers(bytelevel)[which], ids)
    assert "".join(deltas) + tail == bytelevel.decode(ids) == "日本 ok 😀"
    assert tail == ""


@pytest.mark.parametrize("which", ["tokenizers", "fallback"])
def test_prompt_context_keeps_leading_space(metaspace, bytelevel, which):
    prompt, gen = metaspace.encode("the fox").ids, metaspace.encode(" jumps 日本").ids
    assert metaspace.id_to_token(gen[0]).startswith("▁")
    full = metaspace.decode(prompt + gen)
    deltas, tail = stream(wrappers(metaspace)[which], gen, prompt_ids=prompt)
    assert "".join(deltas) + tail == full[len(metaspace.decode(prompt)) :] == " jumps 日本"
    deltas, tail = stream(wrappers(metaspace)[which], gen)  # no context: as decode(gen) strips it
    assert "".join(deltas) + tail == metaspace.decode(gen) == "jumps 日本"
    # Byte-level BPE: with or without prompt context the text is decode(gen).
    prompt, gen = bytelevel.encode("the fox").ids, bytelevel.encode(" jumps 😀").ids
    deltas, tail = stream(wrappers(bytelevel)[which], gen, prompt_ids=prompt)
    assert "".join(deltas) + tail == bytelevel.decode(gen)


@pytest.mark.parametrize("which", ["tokenizers", "fallback"])
def test_prompt_ending_mid_character(bytelevel, which):
    ids = bytelevel.encode("ab 😀 cd").ids
    cut = next(n for n in range(1, len(ids)) if bytelevel.decode(ids[:n]).endswith("\ufffd"))
    deltas, tail = stream(wrappers(bytelevel)[which], ids[cut:], prompt_ids=ids[:cut])
    assert "".join(deltas) + tail == bytelevel.decode(ids[cut:])


def test_truncated_character_released_by_flush(bytelevel):
    ids = bytelevel.encode("a😀").ids
    detok = IncrementalDetokenizer(bytelevel)
    deltas = [detok.push(i) for i in ids[:-1]]
    assert "".join(deltas) == "a"
    assert detok.flush() == bytelevel.decode(ids[:-1])[1:] == "\ufffd"
    assert detok.flush() == ""


@settings(max_examples=60, deadline=None)
@given(data=st.data(), which=st.sampled_from(["tokenizers", "fallback"]))
def test_random_byte_level_ids(data, which):
    # Arbitrary ids, including invalid UTF-8 byte runs and special tokens, still join to decode().
    tok = byte_level_bpe()
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=30))
    deltas, tail = stream(wrappers(tok)[which], ids)
    assert "".join(deltas) + tail == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), which=st.sampled_from(["tokenizers", "fallback"]))
def test_random_metaspace_ids(data, which):
    # Specials and merged pieces (ids past the 256 byte tokens): exact, spaces included.
    tok = metaspace_bpe()
    top = tok.get_vocab_size() - 1
    ids = data.draw(st.lists(st.one_of(st.integers(0, 2), st.integers(259, top)), max_size=30))
    deltas, tail = stream(wrappers(tok)[which], ids)
    assert "".join(deltas) + tail == tok.decode(ids)
    # Any ids at all, invalid byte runs included: never raises, text() agrees with the deltas.
    stream(wrappers(tok)[which], data.draw(st.lists(st.integers(0, top), max_size=30)))


@pytest.mark.parametrize("which", ["tokenizers", "fallback"])
def test_invalid_byte_run_after_complete_character(metaspace, which):
    # DecodeStream raises "Invalid prefix" here, because decode() retroactively turns the
    # finished emoji into U+FFFD; the stream keeps what it emitted and goes on.
    byte = [metaspace.token_to_id(f"<0x{b:02X}>") for b in "😀".encode() + b"\x80\x80"]
    ids = byte + metaspace.encode(" the").ids
    assert metaspace.decode(ids) == "\ufffd" * 6 + " the"
    deltas, tail = stream(wrappers(metaspace)[which], ids)
    assert "".join(deltas) + tail == "😀\ufffd\ufffd the"


@pytest.mark.parametrize("which", ["tokenizers", "fallback"])
@pytest.mark.parametrize(("gen_text", "expected"), [(" fun", " fun"), ("😀 fun", "😀 fun")])
def test_prompt_tail_cut_inside_byte_run(metaspace, which, gen_text, expected):
    # The last 6 prompt ids start inside an emoji's byte run, which byte fallback then decodes
    # as all U+FFFD: the context must start on a whole character to keep " fun"'s space.
    prompt = metaspace.encode("ok 😀😀").ids
    gen = metaspace.encode(gen_text).ids
    if gen_text.startswith("😀"):
        gen = gen[1:]  # drop Metaspace's "▁": the emoji continues the prompt's byte run
    assert metaspace.decode(prompt + gen) == "ok 😀😀" + expected
    deltas, tail = stream(wrappers(metaspace)[which], gen, prompt_ids=prompt)
    assert "".join(deltas) + tail == expected


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.sampled_from("ab é日本語😀👍🏽\n"), max_size=20))
def test_random_texts_stream_without_replacement_chars(text):
    bytelevel = byte_level_bpe()
    ids = bytelevel.encode(text).ids
    deltas, tail = stream(bytelevel, ids)
    assert "".join(deltas) == bytelevel.decode(ids) == text
    assert tail == "" and not any("\ufffd" in d for d in deltas)


def test_litgpt_tokenizer(tmp_path, bytelevel, metaspace):
    torch = pytest.importorskip("torch")
    from litgpt.tokenizer import Tokenizer as LitTokenizer

    for name, tok in {"bl": bytelevel, "ms": metaspace}.items():
        ckpt = tmp_path / name
        ckpt.mkdir()
        tok.save(str(ckpt / "tokenizer.json"))
        config = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
        lit = LitTokenizer(ckpt)
        assert lit.backend == "huggingface"
        for text in TEXTS:
            ids = lit.encode(text, bos=False).tolist()
            deltas, tail = stream(lit, ids)
            assert "".join(deltas) + tail == lit.decode(torch.tensor(ids)) == tok.decode(ids)
            assert tail == ""


def test_rejects_object_without_decode():
    with pytest.raises(TypeError, match="decode"):
        IncrementalDetokenizer(object())
