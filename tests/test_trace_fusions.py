"""What the compiled step fuses (compile/trace_fusions.py): on CPU the KV write is found outside any fusion
(the project's one-op decode attention writes it); on CUDA with nvFuser it runs inside an nvFuser region,
with the same tokens."""

from __future__ import annotations

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.compile.step import execution_traces
from thunder_batch.compile.trace_fusions import fusion_line, fusion_summary

from helpers import mixed_prompts, tiny_gpt

SHAPE = dict(batch_size=2, max_seq_length=16, prefill_chunk=1)  # one step shape: decode rows only


def nvfuser_missing() -> str | None:
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch.cuda.is_available() is False here"
    from thunder_batch.compile.executors import executor_availability

    return executor_availability()["nvfuser"]


def test_cpu_kv_write_is_found_outside_any_fusion():
    engine = Engine(tiny_gpt("llama", n_layer=1), EngineConfig(**SHAPE))
    engine.warmup()
    summary = fusion_summary(execution_traces(engine.runner.step_fn))
    assert summary["regions"] == 0 and summary["kv_write_fused_in"] == []
    # K and V: written by the decode-only step's one attention op (compile.attention)
    assert summary["kv_write_unfused"] == ["thunder_batch_decode_rows_attention (thunder_batch)"]
    assert fusion_line(summary).endswith("in no fusion; outside: thunder_batch_decode_rows_attention (thunder_batch)")


@pytest.mark.cuda
@pytest.mark.skipif(nvfuser_missing() is not None, reason=str(nvfuser_missing()))
def test_nvfuser_fuses_the_kv_write_and_gives_eager_tokens():
    prompts, params = mixed_prompts(3, [2, 5, 3], seed=2), SamplingParams(max_new_tokens=4)
    config = EngineConfig(**SHAPE, executors=("nvfuser", "sdpa", "torch"))
    engine = Engine(tiny_gpt("llama", n_layer=1).cuda(), config)
    eager = Engine(tiny_gpt("llama", n_layer=1).cuda(), EngineConfig(**SHAPE, compile="eager"))
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == [r.token_ids for r in eager.generate(prompts, params)]
    summary = fusion_summary(execution_traces(engine.runner.step_fn))
    assert summary["regions_by_executor"].get("nvfuser", 0) > 0, fusion_line(summary)
    assert summary["kv_write_fused_in"] and not summary["kv_write_unfused"], fusion_line(summary)
