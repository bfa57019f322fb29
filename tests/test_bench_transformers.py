"""Hugging Face transformers as a benchmark peer, on tiny litgpt models: the converted weights give litgpt's
logits, and `generate` on left-padded static batches gives the engine's greedy tokens, with and without EOS."""

from __future__ import annotations

import math
import sys
from dataclasses import replace

import pytest
import torch

from thunder_batch.bench import hf_transformers as hf
from thunder_batch.bench import run as bench
from thunder_batch.bench.engine_runs import run_engine
from thunder_batch.bench.options import BenchOptions
from thunder_batch.bench.system_run import BenchContext
from thunder_batch.bench.workloads import build_workload

from helpers import tiny_config, tiny_gpt

QUICK = BenchOptions(dataset="random", input_len=10, range_ratio=0.5, progress=False, matmul_n=128, copy_mb=4)


@pytest.mark.parametrize("family", ["llama", "pythia"])
def test_converted_model_gives_litgpt_logits(family):
    gpt = tiny_gpt(family)
    model = hf.to_transformers(gpt)
    assert type(model).__name__ == {"llama": "LlamaForCausalLM", "pythia": "GPTNeoXForCausalLM"}[family]
    ids = torch.randint(0, gpt.config.padded_vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = gpt(ids), model(input_ids=ids).logits
    assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "pythia"])
def test_static_batches_give_the_engines_greedy_tokens(family):
    result = bench.run_benchmark(
        tiny_gpt(family),
        options=replace(
            QUICK,
            num_requests=7,
            max_new_tokens=6,
            batch_size="1,3",
            prefill_chunk=4,
            ignore_eos=True,
            systems="eager,hf-transformers",
        ),
    )
    runs = {(m["system"], m["batch_size"]): m for m in result["runs"]}
    assert set(runs) == {("eager", 1), ("eager", 3), ("hf-transformers", 1), ("hf-transformers", 3)}
    workload = result["workload"]
    assert workload["prompt_len_min"] < workload["prompt_len_max"]  # left padding is exercised
    assert workload["max_new_tokens_min"] < workload["max_new_tokens_max"]  # rows past their limit are cut
    for B in (1, 3):
        peer = runs[("hf-transformers", B)]
        assert peer["token_check"]["mismatched_requests"] == 0 and peer["token_check"]["checked_requests"] == 7
        assert peer["output_tokens"] == 7 * workload["max_new_tokens_mean"]
        assert f"{math.ceil(7 / B)} static batches" in peer["notes"][0]
        eager = runs[("eager", B)]
        assert eager["speedup"]["vs_hf"] == pytest.approx(eager["output_tokens_per_s"] / peer["output_tokens_per_s"])


def test_eos_ends_a_row_and_the_batch_runs_to_its_longest_member():
    gpt = tiny_gpt("llama")
    workload = build_workload("random", 6, 12, seed=3, input_len=8, range_ratio=0.5, vocab_size=256)
    ctx = BenchContext(device=torch.device("cpu"), max_seq_length=64, prefill_chunk=4, progress=False)
    free = [t.token_ids for t in run_engine(gpt, workload, "eager", 3, ctx).traces]
    # EOS: the third token of some request that another request never emits
    eos = next(ids[2] for ids in free if any(ids[2] not in other for other in free))
    # greedy tokens do not depend on stopping: the engine's output up to the first EOS is the oracle
    expected = [ids[: ids.index(eos)] if eos in ids else ids for ids in free]
    ctx.eos_id = eos
    peer = hf.run_transformers(gpt, workload, "hf-transformers", 3, ctx)
    assert [t.token_ids for t in peer.traces] == expected
    assert any(len(ids) < r.max_new_tokens for r, ids in zip(workload, expected))  # stopped by EOS
    assert any(len(ids) == r.max_new_tokens for r, ids in zip(workload, expected))  # ran to its limit


def test_online_runs_skip_the_peer_and_other_layouts_are_refused():
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=3,
            max_new_tokens=3,
            batch_size="2",
            request_rate=50.0,
            ignore_eos=True,
            systems="eager,hf-transformers",
        ),
    )
    assert "offline workloads only" in result["skipped"]["hf-transformers"]
    assert [m["system"] for m in result["runs"]] == ["eager"]
    with pytest.raises(
        ValueError, match="Llama and GPT-NeoX layouts only; .* mlp_class_name='GemmaMLP' \\(Llama: 'LLaMAMLP'\\)"
    ):
        hf.layout_of(tiny_config("gemma2"))
    assert hf.unavailable() is None  # the test extra installs transformers


def test_a_missing_transformers_is_reported_not_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(QUICK, num_requests=2, max_new_tokens=2, batch_size="2", systems="eager,hf-transformers"),
    )
    assert result["skipped"] == {"hf-transformers": hf.INSTALL_HINT}


def test_vs_hf_takes_the_faster_peer_and_its_goal_follows_the_workload():
    from thunder_batch.bench import report

    def run(system, B, rate):
        return dict(system=system, precision="float32", batch_size=B, output_tokens_per_s=rate)

    metrics = [
        run("hf-transformers", 8, 40.0),
        run("hf-transformers-compile", 8, 50.0),
        run("eager", 8, 45.0),
        run("thunder-torch", 8, 60.0),
        run("thunder-torch", 32, 150.0),
        run("hf-transformers", 32, 60.0),
    ]
    report.speedups(metrics)
    assert metrics[3]["speedup"]["vs_hf"] == pytest.approx(1.2) and metrics[2]["speedup"]["vs_hf"] == pytest.approx(0.9)
    assert metrics[4]["speedup"]["vs_hf"] == pytest.approx(2.5)
    for equal, goal in ((True, 1.0), (False, 1.5)):
        rows = {(t["target"], t["where"]): t for t in report.targets(metrics, equal_outputs=equal)}
        at8 = rows[("output tok/s vs_hf", "thunder-torch float32 B=8")]
        assert at8["goal"] == goal and at8["met"] is (1.2 >= goal)
        best = rows[("output tok/s vs_hf, fastest Thunder run", "thunder-torch float32 B=32")]
        assert best["goal"] == 3.0 and best["measured"] == pytest.approx(2.5) and best["met"] is False
    without = report.targets([m for m in metrics if not m["system"].startswith("hf-")])
    assert not [t for t in without if "vs_hf" in t["target"]]  # no peer ran: no vs_hf rows


@pytest.mark.slow
def test_compiled_forward_gives_the_same_tokens():
    """generate's torch.compile of the decode forward (on CPU: tens of seconds of Inductor compile per shape)."""
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=4,
            max_new_tokens=5,
            batch_size="2",
            prefill_chunk=4,
            ignore_eos=True,
            systems="eager,hf-transformers-compile",
        ),
    )
    peer = next(m for m in result["runs"] if m["system"] == "hf-transformers-compile")
    assert peer["token_check"]["mismatched_requests"] == 0 and peer["output_tokens"] > 0
    assert peer["compile"]["first_pass_s"] > 0 and peer["compile"]["cold_s"] >= 0
