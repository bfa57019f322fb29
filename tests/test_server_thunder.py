"""`thunder-batch serve --compile thunder`: a real server process whose step programs are traced by
Thunder at startup and stored in the compile cache; a second server loads them from disk. Answers are
checked against an eager engine on the same checkpoint (the eager path is the oracle for the compiled one).

The checkpoint is the default model cut to its first two layers (real tokenizer, real weights), so a
cold start traces in seconds instead of minutes; slow-marked with the other server-process tests."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from live_server import ROOT, Server

ENGINE = dict(batch_size=4, max_seq_length=64, prefill_chunk=8)
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fib(n):",
    "Water boils at",
    "The quick brown fox",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def two_layer_checkpoint(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's embeddings, first two blocks, final norm and tokenizer, in a dir of the
    same name (litgpt picks the tokenizer's BOS handling and the chat template from that name)."""
    import torch
    from litgpt import Config
    from litgpt.utils import save_config

    from thunder_batch.checkpoints import default_checkpoint_dir

    source = default_checkpoint_dir(ROOT / "checkpoints")
    out = tmp_path_factory.mktemp("ckpt") / source.name
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, out / name)
    save_config(Config.from_file(source / "model_config.yaml", n_layer=2), out)
    state = torch.load(source / "lit_model.pth", mmap=True, weights_only=True)
    keep = {
        k: v.clone() for k, v in state.items() if not k.startswith("transformer.h.") or k.split(".")[2] in ("0", "1")
    }
    torch.save(keep, out / "lit_model.pth")
    return out


@pytest.fixture(scope="module")
def expected(two_layer_checkpoint) -> list[str]:
    from thunder_batch import Engine, EngineConfig, SamplingParams

    engine = Engine.from_checkpoint(two_layer_checkpoint, EngineConfig(compile="eager", **ENGINE))
    return [r.text for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_TOKENS))]


def completions(server: Server) -> list[str]:
    """All prompts at once from parallel clients (more requests than slots), greedy."""

    def one(prompt: str) -> str:
        reply = server.client().completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.usage.completion_tokens == MAX_TOKENS
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.mark.slow
def test_thunder_server_traces_once_then_loads_from_the_compile_cache(two_layer_checkpoint, expected, tmp_path):
    args = [f"--{k}={v}" for k, v in ENGINE.items()] + ["--cache_dir", str(tmp_path / "cache")]
    # Cold: per shape a prefix, three heads and the block (3 shapes: decode only, 2 and 4 lanes: 15
    # programs; the second layer is traced once more at the first shape, to learn that block_idx does
    # not matter). Warm: all loaded.
    for run, (traced, loaded) in enumerate([(16, 0), (0, 15)]):
        server = Server(tmp_path / f"server{run}.log", two_layer_checkpoint, *args, compile="thunder")
        try:
            assert completions(server) == expected
            stats = server.wait_all_free()
            # Every step shape made once at startup (traced cold, loaded warm); no request retraced.
            assert stats["cache_misses"] == 3
            assert (stats["traced"], stats["disk_cache_hits"]) == (traced, loaded), stats
            assert stats["programs"] == {"prefix": 3, "block": 3, "head": 3, "head-unfiltered": 3, "head-greedy": 3}
            assert stats["cache_hits"] > 0
        finally:
            assert server.stop() == 0, server.log()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 18  # 15 pieces and each shape's block layout
