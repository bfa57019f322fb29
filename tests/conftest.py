"""Session fixtures: a fresh compile cache per test session, shared Thunder engines, the family parameter.
Helpers (tiny models, the greedy oracle) live in helpers.py."""

from __future__ import annotations

import pytest

from helpers import ENGINE_CONFIG, FAMILY_CONFIGS, defaults_without_fusion, tiny_gpt


@pytest.fixture(autouse=True, scope="session")
def fresh_compile_cache(tmp_path_factory):
    """Every test session compiles into its own cache dir, never the user's ./compile_cache: tests
    that count traces or inspect them must see this session's programs."""
    import os

    previous = os.environ.get("THUNDER_BATCH_CACHE_DIR")
    os.environ["THUNDER_BATCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile_cache"))
    yield
    if previous is None:
        os.environ.pop("THUNDER_BATCH_CACHE_DIR")
    else:
        os.environ["THUNDER_BATCH_CACHE_DIR"] = previous


@pytest.fixture(autouse=True, scope="session")
def real_default_executors():
    """In-process engines with the default executors run without the Inductor fusion (session-wide, so
    module and session fixtures' engines too) unless the test is marked `fusion`: its subject is not the
    executor, and compiling regions costs seconds each on this CPU. Subprocesses (the CLI, the server)
    run the real defaults. Yields the real `default_executors`."""
    from thunder_batch.compile import executors

    real = executors.default_executors
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(executors, "default_executors", defaults_without_fusion(real))
        yield real


@pytest.fixture(autouse=True)
def fusion_when_marked(request, monkeypatch, real_default_executors):
    if request.node.get_closest_marker("fusion"):
        from thunder_batch.compile import executors

        monkeypatch.setattr(executors, "default_executors", real_default_executors)


@pytest.fixture(scope="session")
def thunder_engine():
    """Thunder engines shared across tests (tracing is the slow part): family -> Engine built on
    `tiny_gpt(family)` with ENGINE_CONFIG. Tests must leave every slot free."""
    from thunder_batch import Engine, EngineConfig

    engines = {}

    def get(family: str) -> Engine:
        if family not in engines:
            engines[family] = Engine(tiny_gpt(family), EngineConfig(compile="thunder", **ENGINE_CONFIG))
        assert not engines[family].has_unfinished()
        return engines[family]

    return get


@pytest.fixture(params=list(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def bytes_tokenizer(tmp_path_factory) -> str:
    """A GGUF holding only a byte-level tokenizer of 258 tokens, for written files to copy: they read back in a
    blink (the bundled file's 49k tokens and merges take the gguf reader seconds per file)."""
    import gguf
    from tokenizers import pre_tokenizers

    path = tmp_path_factory.mktemp("tokenizer") / "bytes.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ĠĠ", "<|endoftext|>"])
    writer.add_token_types([1] * 257 + [3])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(257)
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    return str(path)
