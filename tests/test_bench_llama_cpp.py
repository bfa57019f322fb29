"""llama.cpp as a bench peer (bench/llama_cpp.py): skipped with one line saying how to get it when no build
or GGUF is given; a GGUF's precision read from its header; with a real build and GGUFs in the environment
($LLAMA_CPP_BIN, $LLAMA_CPP_GGUF: benchmarks/RESULTS.md, Peer setup), a real run beside the engine."""

from __future__ import annotations

import os
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


def write_gguf(path, file_type: int) -> None:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_ggufs_precision_comes_from_its_header(tmp_path):
    write_gguf(tmp_path / "f32.gguf", 0)
    write_gguf(tmp_path / "bf16.gguf", 32)
    write_gguf(tmp_path / "q4.gguf", 3)
    both = f"{tmp_path / 'f32.gguf'},{tmp_path / 'bf16.gguf'}"
    assert llama_cpp.ggufs_by_precision(both) == {
        "float32": str(tmp_path / "f32.gguf"),
        "bfloat16": str(tmp_path / "bf16.gguf"),
    }
    with pytest.raises(ValueError, match="quantized"):
        llama_cpp.gguf_precision(str(tmp_path / "q4.gguf"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").touch()
    assert llama_cpp.unavailable(str(tmp_path / "bin"), both) is None
    assert "quantized" in llama_cpp.unavailable(str(tmp_path / "bin"), str(tmp_path / "q4.gguf"))
    assert "not found" in llama_cpp.unavailable(str(tmp_path / "bin"), str(tmp_path / "none.gguf"))


@pytest.mark.slow
@pytest.mark.skipif(
    not (llama_cpp.server_path(None) and os.environ.get("LLAMA_CPP_GGUF")),
    reason="needs a llama.cpp build ($LLAMA_CPP_BIN) and a GGUF of the default model ($LLAMA_CPP_GGUF)",
)
def test_llama_cpp_runs_the_same_requests_beside_the_engine():
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

    gpt, _, _ = load_checkpoint(default_checkpoint_dir())
    result = bench.run_benchmark(
        gpt,
        options=replace(
            QUICK,
            num_requests=4,
            max_new_tokens=8,
            batch_size="2",
            ignore_eos=True,
            systems="eager,llama.cpp",
            llama_cpp_gguf=os.environ["LLAMA_CPP_GGUF"],
        ),
    )
    runs = {m["system"]: m for m in result["runs"] if m["precision"] == "float32"}
    assert runs["llama.cpp"]["output_tokens"] == runs["eager"]["output_tokens"] > 4 * 4  # each request's own limit
    check = runs["llama.cpp"]["token_check"]  # greedy ids against the engine's eager run, same precision
    assert check["checked_requests"] == 4 and check["mismatched_requests"] <= 1  # fp32 kernels: near-ties only
    assert runs["llama.cpp"]["llama_cpp"]["per_sequence_decode_tok_s"] > 0
