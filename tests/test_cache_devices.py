"""Compile cache entries do not depend on the device index: an entry written for cuda:1 loads on cuda:0.

On CPU: entries the engine really wrote, rewritten as if traced on another CUDA device (their source's
device strings, as Thunder prints them), go through the key and the store of a third one. On CUDA with
two devices: an engine on cuda:1 runs from the entries an engine on cuda:0 wrote."""

from __future__ import annotations

import json

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile import cache
from thunder_batch.compile.cache import DEVICE_MARK, CacheKey, CompileCacheFiles

from helpers import mixed_prompts, tiny_gpt

SHAPE = dict(batch_size=2, max_seq_length=16, prefill_chunk=4)


def stored_entries(root) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(root.glob("*.json"))]


def test_stored_source_names_no_device_index(tmp_path, monkeypatch):
    engine = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(**SHAPE, cache_dir=str(tmp_path / "cpu")))
    engine.warmup()
    entries = [e for e in stored_entries(tmp_path / "cpu") if "source" in e["record"]]
    assert any('torch.device("cpu")' in e["record"]["source"] for e in entries)  # what traces print
    on = {i: CompileCacheFiles(tmp_path / "cuda", torch.device(f"cuda:{i}")) for i in (0, 1)}
    for entry in entries:
        written_on_1 = entry["record"]["source"].replace('torch.device("cpu")', 'torch.device("cuda:1")')
        key = CacheKey(**{k: tuple(map(tuple, v)) if k == "versions" else v for k, v in entry["key"].items()})
        key = cache.dataclasses.replace(key, device_kind="cuda:NVIDIA H200:sm90", executors=tuple(key.executors))
        assert on[1].save(key, dict(entry["record"], source=written_on_1))
        text = on[1].path(key).read_text()
        assert "cuda:1" not in text and ("cuda:" not in written_on_1 or DEVICE_MARK in text)
        assert on[0].load(key)["source"] == written_on_1.replace('"cuda:1"', '"cuda:0"')
        assert on[1].load(key)["source"] == written_on_1
    # The key's device part: the kind (name, capability), never the index.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert (
        cache.device_kind(torch.device("cuda:0"))
        == cache.device_kind(torch.device("cuda:1"))
        == ("cuda:NVIDIA H200:sm90")
    )


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_entries_written_on_cuda0_run_on_cuda1(tmp_path):
    config = EngineConfig(**SHAPE, cache_dir=str(tmp_path))
    prompts = mixed_prompts(3, [2, 5, 7], seed=1)
    params = SamplingParams(max_new_tokens=4)
    first = Engine(tiny_gpt("llama", n_layer=1).to("cuda:0"), config)
    want = [r.token_ids for r in first.generate(prompts, params)]
    second = Engine(tiny_gpt("llama", n_layer=1).to("cuda:1"), config)
    assert [r.token_ids for r in second.generate(prompts, params)] == want
    stats = second.stats()
    assert stats["traced"] == 0 and stats["disk_cache_hits"] > 0, stats
