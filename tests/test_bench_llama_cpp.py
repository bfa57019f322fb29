"""llama.cpp as a bench peer (bench/llama_cpp.py): skipped with one line saying how to get it when no build is
given; with a real build in the environment ($LLAMA_CPP_BIN: benchmarks/RESULTS.md, Peer setup), real runs beside
the engine on the file the bench writes, and on the bundled Q4_1 file as it is. Which file serves which model:
test_gguf_files.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from thunder_batch.bench import llama_cpp
from thunder_batch.bench import run as bench
from thunder_batch.bench.options import BenchOptions

from helpers import tiny_gpt

QUICK = BenchOptions(dataset="random", input_len=6, matmul_n=64, copy_mb=1, progress=False, warm_compile=False)


def test_without_a_build_llama_cpp_is_skipped_with_how_to_get_it(monkeypatch):
    monkeypatch.delenv(llama_cpp.ENV_VAR, raising=False)
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(QUICK, num_requests=2, max_new_tokens=2, batch_size="2", systems="eager,llama.cpp"),
    )
    assert [m["system"] for m in result["runs"]] == ["eager"]
    why = result["skipped"]["llama.cpp"]
    assert "--llama_cpp_bin" in why and "--llama_cpp_gguf" in why and "convert_hf_to_gguf.py" in why


NO_BUILD = "needs a llama.cpp build ($LLAMA_CPP_BIN: benchmarks/RESULTS.md, Peer setup)"


@pytest.mark.slow
@pytest.mark.skipif(llama_cpp.server_path(None) is None, reason=NO_BUILD)
@pytest.mark.parametrize("weights", ["written f32", "bundled q4_1"])
def test_llama_cpp_runs_the_same_requests_on_the_same_weights(weights):
    """The default model's fp32 weights (written by the bench) or its Q4_1 file (given as it is, kept quantized by
    the engine): llama.cpp's greedy tokens against the engine's eager run, and its server's own peak memory."""
    from thunder_batch.checkpoints import bundled_gguf_path, default_checkpoint_dir, load_checkpoint

    source = bundled_gguf_path() if weights == "bundled q4_1" else default_checkpoint_dir()
    gpt, _, _ = load_checkpoint(source)
    options = replace(QUICK, num_requests=4, max_new_tokens=8, batch_size="2", ignore_eos=True)
    given = str(source) if weights == "bundled q4_1" else None
    result = bench.run_benchmark(gpt, options=replace(options, systems="eager,llama.cpp", llama_cpp_gguf=given))
    runs = {m["system"]: m for m in result["runs"] if m["precision"] == "float32"}
    assert runs["llama.cpp"]["output_tokens"] == runs["eager"]["output_tokens"] > 4 * 4  # each request's own limit
    check = runs["llama.cpp"]["token_check"]  # greedy ids against the engine's eager run, same weights
    assert check["checked_requests"] == 4
    if weights == "written f32":  # other float32 kernels: near-ties only. On Q4_1 llama.cpp multiplies activations
        assert check["mismatched_requests"] <= 1  # rounded to 8 bits (the engine is exact to the file): reported only
    peer = runs["llama.cpp"]["llama_cpp"]
    assert peer["per_sequence_decode_tok_s"] > 0 and peer["file_type"] == weights.split()[1]
    assert (peer["gguf"] == given) == (given is not None)
    assert runs["llama.cpp"]["memory"]["peak_rss_mb"] > 50  # the server's own, not the bench's
