"""The benchmark on tiny litgpt models: workloads, metrics, token checks, JSON, plot, eager and Thunder."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from thunder_batch.bench import run as bench
from thunder_batch.bench.metrics import ModelCost, RequestTrace, summary
from thunder_batch.bench.options import BenchOptions
from thunder_batch.bench.parity import compare_tokens
from thunder_batch.bench.workloads import build_workload, load_prompts, poisson_arrivals, same_length_groups
from thunder_batch.cli.bench import bench as bench_command
from thunder_batch.native import build

from helpers import tiny_gpt

QUICK = BenchOptions(
    dataset="random", input_len=10, range_ratio=0.5, ignore_eos=True, progress=False, matmul_n=128, copy_mb=4
)


def test_shipped_prompts_are_real_and_varied():
    prompts = load_prompts()
    assert 60 <= len(prompts) <= 70 and len(set(prompts)) == len(prompts)
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 40 and lengths[-1] > 600  # short questions and long instructions
    assert sum(p.endswith("?") for p in prompts) >= 15


def test_workload_is_seeded_with_lengths_in_range():
    make = lambda seed: build_workload("random", 20, 16, seed=seed, input_len=10, range_ratio=0.5, vocab_size=256)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    assert a == b and a != c
    assert all(5 <= len(r.prompt_ids) <= 15 and 8 <= r.max_new_tokens <= 16 for r in a)
    assert all(r.arrival_s == 0 for r in a)
    encode = lambda s: [ord(ch) % 256 for ch in s]  # noqa: E731
    texts = build_workload("prompts", 70, 8, encode=encode)
    assert len({r.prompt_ids for r in texts}) == 64  # cycled past the 64 shipped prompts
    cut = build_workload("prompts", 70, 8, encode=encode, max_seq_length=100)
    assert max(len(r.prompt_ids) + r.max_new_tokens for r in cut) <= 100  # long prompts cut to fit
    with pytest.raises(ValueError, match="tokenizer"):
        build_workload("prompts", 2, 4)


def test_poisson_arrivals_and_same_length_groups():
    times = poisson_arrivals(random.Random(0), 2000, request_rate=20.0)
    assert times == sorted(times) and abs(times[-1] / 2000 - 1 / 20) < 0.005
    workload = build_workload("random", 9, 4, input_len=3, range_ratio=0.0, vocab_size=50)
    assert [len(g) for g in same_length_groups(workload, 4)] == [4, 4, 1]


def test_request_trace_latencies():
    t = RequestTrace(prompt_len=5, arrival=10.0)
    for now in (10.5, 10.7, 11.0, 11.5):
        t.record([1], now)
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.5)
    assert t.tpot == pytest.approx(1.0 / 3) and t.itls() == pytest.approx([0.2, 0.3, 0.5])
    s = summary([1.0, 2.0, 3.0, None, 4.0])
    assert s["n"] == 4 and s["mean"] == 2.5 and s["p50"] == 2.5 and s["p99"] == pytest.approx(3.97)
    assert math.isnan(summary([])["mean"])


def test_flop_count_closed_form_matches_per_token_sum():
    cost = ModelCost.of(tiny_gpt("llama"))
    assert cost.block_linear_params == 2 * (64 * 128 + 64 * 64 + 2 * 64 * 128 + 128 * 64)  # qkv, proj, fc_1/2, fc
    assert cost.span_flops(7, 5) == sum(cost.token_flops(p) for p in range(7, 12))
    assert cost.request_flops(4, 3) == cost.span_flops(0, 6) + 3 * 2 * cost.lm_head_params


def test_compare_tokens_reports_the_first_divergence():
    ok = compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert ok["mismatched_requests"] == 0 and ok["first_mismatch"] is None
    bad = compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 9, 9]])
    assert bad["mismatched_requests"] == 1
    assert bad["first_mismatch"] == dict(request=1, position=1, expected=[5], got=[9, 9], expected_len=2, got_len=3)


def test_parse_options():
    assert bench.parse_batch_sizes("16,1, 4,4") == [1, 4, 16] and bench.parse_batch_sizes(8) == [8]
    with pytest.raises(ValueError, match="batch"):
        bench.parse_batch_sizes("4,x")
    with pytest.raises(ValueError, match="unknown system"):
        bench.parse_systems("eager,vllm")
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_function_arguments(bench_command)
    assert parser.parse_args(["--batch_size", "1,4,8"]).batch_size == "1,4,8"
    assert bench.parse_batch_sizes(parser.parse_args(["--batch_size", "8"]).batch_size) == [8]
    systems = "eager@float32:32,litgpt-sequential,thunder-torch@bfloat16/float32:64/128"
    parsed = parser.parse_args(["--systems", systems, "--precisions", "float32,bfloat16"])
    assert (parsed.systems, parsed.precisions) == (systems, "float32,bfloat16")  # kept verbatim, not YAML
    assert parser.parse_args([]).precisions is None


@pytest.mark.parametrize(
    "flags, runner, fields",
    [
        (["--batch_size", "1,8", "--max_new_tokens", "5"], "run", dict(batch_size="1,8", max_new_tokens=5)),
        (
            ["--dataset", "multi-turn", "--turns", "3", "--repeats", "2", "--prefix-store-mb", "0"],
            "prefix",
            dict(dataset="multi-turn", turns=3, repeats=2, prefix_store_mb=0),
        ),
        (
            ["--speculative_tokens", "0,4", "--dataset", "grounded", "--ignore-eos", "--systems", "eager"],
            "speculative",
            dict(speculative_tokens="0,4", dataset="grounded", ignore_eos=True, systems="eager"),
        ),
        (
            ["--dataset", "json-schema", "--batch_size", "1,8"],
            "json_schema",
            dict(dataset="json-schema", batch_size="1,8"),
        ),
        (
            ["--llama_cpp_gguf", "a.gguf,b.gguf", "--llama_cpp_bin", "/opt/llama", "--request_rate", "2.5"],
            "run",
            dict(llama_cpp_gguf="a.gguf,b.gguf", llama_cpp_bin=Path("/opt/llama"), request_rate=2.5),
        ),
    ],
)
def test_the_command_gives_its_flags_to_one_benchmark_as_bench_options(monkeypatch, flags, runner, fields):
    """`thunder-batch bench` with the model loading stubbed: the runner its dataset and --speculative_tokens
    pick gets a BenchOptions holding the flags given and every other option's default."""
    import torch

    import thunder_batch.bench.json_schema
    import thunder_batch.bench.prefix_run
    import thunder_batch.bench.speculative
    import thunder_batch.chat
    import thunder_batch.checkpoints
    from thunder_batch.cli.main import main

    gpt, calls = tiny_gpt("llama"), []
    loaded = lambda *args, **kwargs: calls.append(("load", args, kwargs)) or (gpt, None, gpt.config)  # noqa: E731
    monkeypatch.setattr(thunder_batch.checkpoints, "load_checkpoint", loaded)
    monkeypatch.setattr(thunder_batch.chat, "prompt_style_for", lambda config, checkpoint_dir: "style")
    record = lambda name: lambda *args, **kwargs: calls.append((name, args, kwargs))  # noqa: E731
    monkeypatch.setattr(bench, "run_benchmark", record("run"))
    monkeypatch.setattr(thunder_batch.bench.prefix_run, "run_prefix_benchmark", record("prefix"))
    monkeypatch.setattr(thunder_batch.bench.speculative, "run_speculative_benchmark", record("speculative"))
    monkeypatch.setattr(thunder_batch.bench.json_schema, "run_json_schema_benchmark", record("json_schema"))
    main(["bench", "--checkpoint_dir", "checkpoints/tiny", "--precision", "bfloat16", *flags])
    [load, (name, args, kwargs)] = calls
    assert load == ("load", (Path("checkpoints/tiny"),), dict(dtype=torch.bfloat16, device="cpu"))
    options = kwargs.get("options", args[-1])
    assert name == runner and args[0] is gpt and options == replace(BenchOptions(), **fields)
    if runner == "run":
        assert args[1:] == (None, "style") and kwargs["model_label"] == "tiny"


def test_eager_and_litgpt_baselines_end_to_end(tmp_path):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=6,
            max_new_tokens=5,
            batch_size="1,3",
            prefill_chunk=4,
            systems="litgpt-sequential,litgpt-batched,eager",
            output_json=out_json,
            plot=out_png,
        ),
    )
    runs = {(m["system"], m["batch_size"]): m for m in result["runs"]}
    assert set(runs) == {
        ("litgpt-sequential", None),
        ("litgpt-batched", 1),
        ("litgpt-batched", 3),
        ("eager", 1),
        ("eager", 3),
    }
    workload = result["workload"]
    for m in runs.values():
        # ignore_eos: every request produces exactly its limit
        assert m["output_tokens"] == 6 * workload["max_new_tokens_mean"] and m["requests"] == 6
        assert m["output_tokens_per_s"] > 0 and m["ttft_ms"]["n"] == 6 and m["ttft_ms"]["p99"] >= m["ttft_ms"]["p50"]
    # Every run but the reference has its tokens checked, all requests, none off: no check is no pass.
    assert result["token_reference"] == {"float32": "eager@B=1"}
    assert [key for key, m in runs.items() if m.get("token_reference")] == [("eager", 1)]
    for key, m in runs.items():
        if key != ("eager", 1):
            assert (m["token_check"]["checked_requests"], m["token_check"]["mismatched_requests"]) == (6, 0), key
    assert 0 < runs[("eager", 3)]["slot_occupancy"] <= 1 and runs[("eager", 1)]["slot_occupancy"] == 1
    assert runs[("eager", 3)]["decode"]["peak_matmul_fraction"] > 0
    assert "same-length prompts only" in runs[("litgpt-batched", 3)]["notes"][0]
    assert set(result["speedup_vs_litgpt_sequential"]["float32"]) == {"B=1", "B=3"}
    assert all(m["precision"] == "float32" for m in runs.values())
    saved = json.loads(out_json.read_text())
    assert {"meta", "workload", "peaks", "runs", "targets", "speedup_vs_litgpt_sequential", "skipped"} <= set(saved)
    assert saved["meta"]["versions"]["torch"] and saved["peaks"]["matmul_flops_per_s"]["float32"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_perturbed_baseline_is_reported(monkeypatch):
    original = bench.run_system

    def perturbed(name, *args):
        run = original(name, *args)
        if name == "litgpt-sequential":
            run.traces[2].token_ids[1] = (run.traces[2].token_ids[1] + 1) % 256
        return run

    monkeypatch.setattr(bench, "run_system", perturbed)
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK, num_requests=4, max_new_tokens=4, batch_size="2", prefill_chunk=4, systems="litgpt-sequential,eager"
        ),
    )
    check = next(m for m in result["runs"] if m["system"] == "litgpt-sequential")["token_check"]
    assert check["mismatched_requests"] == 1
    assert check["first_mismatch"]["request"] == 2 and check["first_mismatch"]["position"] == 1


def test_online_arrivals_drive_add_request_and_step():
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=4,
            max_new_tokens=3,
            batch_size="2",
            prefill_chunk=4,
            request_rate=40.0,
            systems="litgpt-batched,eager",
        ),
    )
    assert "offline workloads only" in result["skipped"]["litgpt-batched"]
    (run,) = result["runs"]
    assert result["workload"]["mode"].startswith("online") and result["workload"]["last_arrival_s"] > 0
    assert run["output_tokens"] == 4 * result["workload"]["max_new_tokens_mean"] and run["ttft_ms"]["mean"] > 0


def test_poisson_arrivals_with_lanes_and_a_ladder_report_shapes_and_tokens():
    """The admit-cost run at test size: outputs only (greedy tokens equal litgpt's; every shape a step
    ran is one of the config's), never timings."""
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=8,
            max_new_tokens=6,
            batch_size="3",
            prefill_chunk=4,
            prefill_lanes=1,
            attention_lengths="16,32",
            request_rate=50.0,
            systems="litgpt-sequential,eager",
        ),
    )
    runs = {m["system"]: m for m in result["runs"]}
    assert runs["litgpt-sequential"]["token_check"]["mismatched_requests"] == 0
    eager = runs["eager"]
    # lane counts 1 and 3 (a burst, when arrivals bunch up: B = 3 is max_prefill_lanes' default)
    assert set(eager["step_shapes"]) <= {f"lanes={p} L={L}" for p in (0, 1, 3) for L in (16, 32, 64)}
    assert sum(s["steps"] for s in eager["step_shapes"].values()) == eager["steps"]
    assert eager["prefill_steps"] > 0 and eager["decode_steps"] > 0
    assert result["workload"]["prefill_lanes"] == 1 and tuple(result["workload"]["attention_lengths"]) == (16, 32)


def test_attention_ladder_script_gives_the_same_tokens_at_every_length():
    """benchmarks/attention_ladder.py at test size: the exit code says the greedy tokens agree."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "attention_ladder.py"
    args = "--layers 2 --batch-size 2 --live 20 --lengths 32,64 --rungs 32 --steps 2 --rounds 1 --compile eager"
    done = subprocess.run([sys.executable, str(script), *args.split()], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.splitlines()[-2])["rows"]
    assert set(rows) == {"S=32 ladder", "S=64 ladder", "S=64 whole cache"}
    assert "greedy tokens identical across engines: yes" in done.stdout


def test_thunder_torch_matches_eager_with_cold_and_warm_compile():
    # prefill_chunk=1: one step shape (tracing is the slow part on this CPU)
    result = bench.run_benchmark(
        tiny_gpt("llama", n_layer=1),
        options=replace(
            QUICK,
            num_requests=3,
            max_new_tokens=4,
            batch_size="2",
            prefill_chunk=1,
            systems="eager,thunder-default,thunder-torch,thunder-nvfuser",
            profile=True,
        ),
    )
    default = next(m for m in result["runs"] if m["system"] == "thunder-default")  # executors=None
    assert default["token_check"]["mismatched_requests"] == 0
    assert default["compile"]["executors"] == "the defaults (executors=None)"
    thunder = next(m for m in result["runs"] if m["system"] == "thunder-torch")
    assert thunder["token_check"]["mismatched_requests"] == 0
    assert thunder["output_tokens"] == 3 * result["workload"]["max_new_tokens_mean"] > 0
    # one shape: prefix, block and the three heads (filtered, unsorted, greedy), traced then loaded
    assert thunder["compile"]["cold_s"] > 0 and thunder["compile"]["traced"] == 5
    assert thunder["compile"]["disk_cache_hits"] == 5 and thunder["compile"]["warm_s"] < thunder["compile"]["cold_s"]
    # The warm engine ran: it loaded every piece, and Thunder traced nothing before or during the run.
    assert thunder["recompiled"] is False and thunder["engine_stats"]["thunder_traces"] == 0
    assert thunder["profile"]["top_ops"]
    host = thunder["host"]  # input building plus everything outside the step: a share of the wall time
    assert host["inputs_s"] > 0 and host["outside_steps_s"] > 0 and 0 < host["share"] < 1
    assert "speedup" in thunder and "vs_eager" in thunder["speedup"]
    if "thunder-nvfuser" in result["skipped"]:
        assert "unavailable" in result["skipped"]["thunder-nvfuser"]


def test_a_run_that_traces_is_reported_as_recompiled(monkeypatch, tmp_path):
    """Engines left uncompiled before the timed run: Thunder's own trace count says it traced there."""
    from thunder_batch.bench import engine_runs

    def uncompiled(gpt, system, batch_size, ctx):
        config = engine_runs.engine_config(system, batch_size, ctx, str(tmp_path))
        return engine_runs.build_engine(gpt, config, ctx), {}, []

    monkeypatch.setattr(engine_runs, "compile_engine", uncompiled)
    result = bench.run_benchmark(
        tiny_gpt("llama", n_layer=1),
        options=replace(
            QUICK, num_requests=2, max_new_tokens=2, batch_size="2", prefill_chunk=1, systems="eager,thunder-torch"
        ),
    )
    runs = {m["system"]: m for m in result["runs"]}
    assert runs["eager"]["recompiled"] is False
    thunder = runs["thunder-torch"]
    assert thunder["recompiled"] is True and thunder["token_check"]["mismatched_requests"] == 0
    # prefix, block and the greedy head (only greedy requests): each traced once, by the run itself
    assert thunder["engine_stats"]["thunder_traces"] == thunder["engine_stats"]["traced"] == 3


def test_system_restrictions_pick_precisions_and_batch_sizes():
    from thunder_batch.bench.run_plan import SystemSpec, parse_precisions, plan_runs

    specs = bench.parse_systems("litgpt-sequential, eager@bfloat16, thunder-torch@float32/bfloat16:32/8, eager:4")
    assert specs == [
        SystemSpec("litgpt-sequential"),
        SystemSpec("eager", ("bfloat16",)),
        SystemSpec("thunder-torch", ("float32", "bfloat16"), (8, 32)),
        SystemSpec("eager", None, (4,)),
    ]
    plan = plan_runs(specs, ["float32", "bfloat16"], [16, 64])
    assert plan == [
        ("litgpt-sequential", "float32", None),
        ("litgpt-sequential", "bfloat16", None),
        ("eager", "bfloat16", 16),
        ("eager", "bfloat16", 64),
        ("thunder-torch", "float32", 8),
        ("thunder-torch", "float32", 32),
        ("thunder-torch", "bfloat16", 8),
        ("thunder-torch", "bfloat16", 32),
        ("eager", "float32", 4),
        ("eager", "bfloat16", 4),
    ]
    assert parse_precisions(None, "bfloat16") == ["bfloat16"]
    assert parse_precisions("bfloat16, float32,bfloat16", "float32") == ["bfloat16", "float32"]
    for bad, match in (
        ("eager@fp8", "unknown precision"),
        ("vllm@float32", "unknown system"),
        ("eager:0", "batch sizes"),
        ("litgpt-sequential:8", "no batch size"),
    ):
        with pytest.raises(ValueError, match=match):
            bench.parse_systems(bad)
    with pytest.raises(ValueError, match="add them to --precisions"):
        plan_runs(bench.parse_systems("eager@bfloat16"), ["float32"], [4])


def fake_run(system, precision, B, tokens, wall_s, decode_s=None):
    """A SystemRun whose requests (prompt 3) produced `tokens`; with decode_s, one full decode step per token."""
    from thunder_batch.bench.engine_runs import StepRecord
    from thunder_batch.bench.system_run import SystemRun

    traces = []
    for ids in tokens:
        traces.append(RequestTrace(3, 0.0))
        traces[-1].record(ids, 0.5)
    steps = [] if decode_s is None else [StepRecord(0, 256, ((3, 1),) * B, decode_s)] * len(tokens[0])
    return SystemRun(system, B, traces, wall_s, {}, steps=steps, precision=precision)


def test_two_precisions_ratios_token_checks_and_targets_from_fake_runs():
    from thunder_batch.bench import report

    fp32, bf16 = [[1, 2], [3, 4]], [[1, 5], [3, 6]]  # the precisions legitimately disagree
    runs = [
        fake_run("litgpt-sequential", "float32", None, fp32, 1.0),  # 4 tok/s
        fake_run("litgpt-sequential", "bfloat16", None, [[1, 5], [3, 7]], 0.5),  # 8 tok/s, one token off
        fake_run("eager", "bfloat16", 2, bf16, 0.1),
        fake_run("thunder-torch", "bfloat16", 2, bf16, 0.05, 0.01),
        fake_run("eager", "float32", 2, fp32, 0.2),
        fake_run("thunder-torch", "float32", 2, fp32, 0.125, 0.02),
    ]
    cost = ModelCost(
        block_linear_params=1000, lm_head_params=500, n_layer=1, attn_width=8, kv_width=8, weight_bytes=4000
    )
    peaks = dict(matmul_flops_per_s={"float32": 1e6, "bfloat16": 4e6}, copy_bytes_per_s=1e9)
    metrics = [report.run_metrics(r, cost, peaks, 100) for r in runs]
    assert [m["precision"] for m in metrics] == [r.precision for r in runs]
    # Each request by hand: 3 prompt tokens and the first output token fed (positions 0..3, attending to
    # pos + 1 keys), the lm_head once per output token; two requests per run.
    fed = sum(2 * 1000 + 4 * 1 * 8 * (pos + 1) for pos in range(4))
    useful = 2 * (fed + 2 * 2 * 500)
    for m, r in zip(metrics, runs):
        peak = peaks["matmul_flops_per_s"][r.precision]
        assert m["peak_matmul_fraction"] == pytest.approx(useful / r.wall_s / peak)
    step_flops = 2 * (cost.span_flops(3, 1) + 2 * cost.lm_head_params)  # two busy slots per decode step
    assert metrics[3]["full_decode"]["peak_matmul_fraction"] == pytest.approx(step_flops / 0.01 / 4e6)
    assert metrics[5]["full_decode"]["peak_matmul_fraction"] == pytest.approx(step_flops / 0.02 / 1e6)

    assert report.check_all(runs, metrics) == {"float32": "eager@B=2", "bfloat16": "eager@B=2"}
    checks = [m.get("token_check", {}).get("mismatched_requests") for m in metrics]
    assert checks == [0, 1, None, 0, None, 0]  # each against its own precision's eager run
    assert metrics[2]["token_reference"] and metrics[4]["token_reference"]

    table, baseline = report.speedups(metrics)
    assert baseline == dict(
        precision="bfloat16", output_tokens_per_s=8.0, by_precision={"float32": 4.0, "bfloat16": 8.0}
    )
    assert metrics[3]["speedup"] == pytest.approx(dict(vs_litgpt_sequential=10.0, vs_eager=2.0))
    assert metrics[5]["speedup"] == pytest.approx(dict(vs_litgpt_sequential=4.0, vs_eager=1.6))
    assert table == {
        "bfloat16": {"B=2": pytest.approx({"eager": 5.0, "thunder-torch": 10.0})},
        "float32": {"B=2": pytest.approx({"eager": 2.5, "thunder-torch": 4.0})},
    }

    rows = {(t["target"], t["where"]): t for t in report.targets(metrics)}
    best = "thunder-torch bfloat16 B=2 (best)"
    assert rows[("output tok/s vs_litgpt_sequential", best)]["measured"] == pytest.approx(10.0)
    assert rows[("output tok/s vs_litgpt_sequential", best)]["met"] is False  # goal 12x
    assert rows[("output tok/s vs_eager", best)]["goal"] == 1.3 and rows[("output tok/s vs_eager", best)]["met"]
    assert rows[("output tok/s vs_eager", "thunder-torch float32 B=2")]["measured"] == pytest.approx(1.6)
    assert rows[("output tok/s vs_litgpt_batched", best)]["measured"] is None  # litgpt-batched did not run
    decode = rows[("decode FLOP/s / peak matmul at its precision", best)]
    assert decode["measured"] == pytest.approx(step_flops / 0.01 / 4e6) and decode["best"]
    assert rows[("one request's decode tok/s (bf16, B=1)", "no Thunder run at B=1 in bf16")]["measured"] is None
    assert len(rows) == 8  # three ratios per (precision, B) with a Thunder run, one decode row, one latency row


def test_latency_and_compile_targets_read_the_decode_steps_and_the_compile_times():
    from thunder_batch.bench import report

    def run(precision, B, step_ms, compile_info=None):
        return dict(
            system="thunder-x",
            precision=precision,
            batch_size=B,
            decode=dict(mean_step_ms=step_ms),
            compile=compile_info,
        )

    cold = dict(cold_s=30.0, cold_per_shape_s={"a": 20.0, "b": 10.0}, warm_s=6.0)
    metrics = [run("float32", 1, 10.0), run("bfloat16", 1, 25.0, cold), run("bfloat16", 8, 40.0)]
    rows = {t["target"]: t for t in report.latency_and_compile_targets(metrics)}
    single = rows["one request's decode tok/s (bf16, B=1)"]
    assert single["measured"] == pytest.approx(40.0) and single["met"]  # 1000 / 25 ms; fp32's 10 ms is not bf16
    per_shape = rows["cold compile s per step shape"]
    assert per_shape["measured"] == pytest.approx(15.0) and per_shape["met"]  # 30 s over two shapes, at most 20
    warm = rows["warm start / cold compile"]
    assert warm["measured"] == pytest.approx(0.2) and warm["met"] is False  # at most 0.15


def test_two_precision_run_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = bench.run_benchmark(
        tiny_gpt("llama"),
        options=replace(
            QUICK,
            num_requests=4,
            max_new_tokens=4,
            batch_size="1,2",
            prefill_chunk=4,
            precisions="float32,bfloat16",
            output_json=out_json,
            plot=out_png,
            systems="litgpt-sequential,eager@bfloat16,eager@float32:2",
        ),
    )
    runs = {(m["system"], m["precision"], m["batch_size"]): m for m in result["runs"]}
    assert list(runs) == [
        ("litgpt-sequential", "float32", None),
        ("litgpt-sequential", "bfloat16", None),
        ("eager", "bfloat16", 1),
        ("eager", "bfloat16", 2),
        ("eager", "float32", 2),
    ]
    peaks = result["peaks"]["matmul_flops_per_s"]
    assert set(peaks) == {"float32", "bfloat16"} and min(peaks.values()) > 0
    for (_, precision, _), m in runs.items():  # each run against its own precision's peak (the math: above)
        other = next(p for p in peaks if p != precision)
        assert m["peak_matmul_fraction"] == pytest.approx(m["flops_per_s"] / peaks[precision])
        assert m["peak_matmul_fraction"] != pytest.approx(m["flops_per_s"] / peaks[other])
        assert m["output_tokens"] == 4 * result["workload"]["max_new_tokens_mean"]
    assert result["token_reference"] == {"float32": "eager@B=2", "bfloat16": "eager@B=1"}
    # fp32: litgpt and the engine agree exactly; bf16 runs are checked only against bf16 runs
    assert runs[("litgpt-sequential", "float32", None)]["token_check"]["mismatched_requests"] == 0
    assert runs[("eager", "bfloat16", 2)]["token_check"]["checked_requests"] == 4
    base = result["litgpt_sequential_baseline"]
    seq = {p: runs[("litgpt-sequential", p, None)]["output_tokens_per_s"] for p in peaks}
    assert base["by_precision"] == seq and base["output_tokens_per_s"] == max(seq.values())
    eager = runs[("eager", "float32", 2)]
    assert eager["speedup"]["vs_litgpt_sequential"] == pytest.approx(eager["output_tokens_per_s"] / max(seq.values()))
    assert result["model"]["label"] == "model float32,bfloat16"
    assert result["model"]["weight_bytes"]["bfloat16"] * 2 == result["model"]["weight_bytes"]["float32"]
    saved = json.loads(out_json.read_text())
    assert saved["litgpt_sequential_baseline"]["precision"] == base["precision"]
    assert [m["precision"] for m in saved["runs"]] == [k[1] for k in runs]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "reference tokens per precision: float32: eager@B=2, bfloat16: eager@B=1" in printed
    assert f"x seq: over litgpt-sequential {base['precision']}" in printed
    from thunder_batch.compile.project_executor import linear_kernels

    kernels = saved["meta"]["linear_kernels"]  # the CPU's linear kernels per precision, printed
    assert kernels == linear_kernels() and f"CPU linears: float32 {kernels['float32']}; bfloat16" in printed
    if {"amx_bf16", "amx_tile"} <= build.cpu_flags():
        assert "bfloat16 AMX tiles, any rows (bf16 weights are the fast path here)" in printed


@pytest.mark.slow
def test_the_json_schema_bench_runs_free_constrained_and_forced_on_the_same_requests(monkeypatch):
    """The real model, eager: every constrained answer parses, forced tokens (always, and where they pay) give the
    tokens of one step each (always: in fewer steps), the free run is as long, and the ratios are to it; llama.cpp
    is skipped without a build."""
    from thunder_batch.bench.json_schema import run_json_schema_benchmark
    from thunder_batch.chat import prompt_style_for
    from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    gpt, tokenizer, config = load_checkpoint(default_checkpoint_dir())
    options = BenchOptions(dataset="json-schema", systems="eager", batch_size="2", num_requests=4, max_new_tokens=64)
    rows = run_json_schema_benchmark(gpt, tokenizer, prompt_style_for(config, default_checkpoint_dir()), options)
    constrained, free, forced, gated = rows
    assert [r["variant"] for r in rows] == ["json_schema", "free", "json_schema+forced", "json_schema+gate"]
    assert constrained["parsed"] == forced["parsed"] == gated["parsed"] == 4 and free["parsed"] == 0
    assert forced["tokens_equal_to_one_step_each"] and gated["tokens_equal_to_one_step_each"]
    assert free["generated_tokens"] == constrained["generated_tokens"]  # like for like
    assert forced["steps"] < constrained["steps"] and free["tok_s_x_free"] == 1.0
    assert constrained["tok_s_x_free"] == round(constrained["tok_s"] / free["tok_s"], 3)
