"""A decode-only step's llama-shaped block as one native op (compile.block_op): the model's block math,
KV writes included, on float32 and bfloat16; taken only where it runs every piece natively and the fusion is
on; and a compiled engine whose decode blocks are the one op gives litgpt's tokens, stores it and loads it."""

from __future__ import annotations

import warnings

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams, quantized
from thunder_batch.compile.attention import DECODE_BLOCK
from thunder_batch.compile.cache import CompileCacheWarning
from thunder_batch.compile.step import execution_traces
from thunder_batch.native import build

from helpers import VOCAB, litgpt_greedy, mixed_prompts, tiny_gpt

needs_kernels = pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")


def block_inputs(dtype, n_elem: int, qkv_bias: bool, generator):
    """Random inputs of `model.decode_block`: 3 slots at their own positions, C=128, H=4 over G=2 heads of
    D=32, F=256 (the MLP's width); weights qkv, its bias (or None), proj, fc_1, fc_2, mlp_proj; masks of two
    kinds (the second hides one more entry), the layer reading the second."""
    B, C, H, G, D, F, S, L = 3, 128, 4, 2, 32, 256, 24, 16

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype)

    from thunder_batch.index_ops import flat_rows

    pos = torch.tensor([0, 7, 15])
    angles = pos.view(B, 1, 1) * torch.rand(n_elem, generator=generator)  # [B, 1, n_elem] float32
    cos, sin = angles.cos(), angles.sin()
    visible = torch.stack([torch.arange(L) <= pos.view(B, 1, 1, 1), torch.arange(L) < pos.view(B, 1, 1, 1)])
    masks = torch.where(visible | (pos.view(1, B, 1, 1, 1) == 0), 0.0, torch.finfo(dtype).min).to(dtype)
    weights = [rand(o, i, scale=i**-0.5) for o, i in [((H + 2 * G) * D, C), (C, H * D), (F, C), (F, C), (C, F)]]
    weights.insert(1, rand((H + 2 * G) * D) if qkv_bias else None)
    caches = rand(2, B, G, S, D)
    rows = flat_rows(caches[0].shape, 2, torch.arange(B), pos)
    norms = [1 + rand(C, scale=0.1) for _ in range(2)]
    return rand(B, C), norms, weights, cos, sin, caches, rows, masks


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_elem,qkv_bias", [(32, False), (16, False), (32, True)])  # half the head rotated; Qwen2
def test_the_one_op_computes_the_models_block_and_writes_its_cache_entries(dtype, n_elem, qkv_bias):
    """The native op against `model.decode_block` run op by op (torch's kernels) and in float64: the same
    outputs within rounding, the same K and V entries written, every other entry untouched."""
    from thunder_batch import model
    from thunder_batch.compile import block_op
    from thunder_batch.compile.project_executor import PACKED

    assert build.unavailable() is None
    x, norms, weights, cos, sin, caches, rows, masks = block_inputs(
        dtype, n_elem, qkv_bias, torch.Generator().manual_seed(3)
    )
    mine, theirs = caches.clone(), caches.clone()
    got = block_op.decode_block(PACKED, x, *norms, *weights, cos, sin, *mine, rows, masks, 1, 1e-5, 1e-6, 0.2)
    want = model.decode_block(x, *norms, *weights, cos, sin, *theirs, rows, masks, 1, 1e-5, 1e-6, 0.2)
    as64 = [None if t is None else t.double() for t in (x, *norms, *weights)]
    exact_caches = caches.double().clone()
    exact = model.decode_block(
        *as64, cos.double(), sin.double(), *exact_caches, rows, masks.double(), 1, 1e-5, 1e-6, 0.2
    )
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    written = torch.zeros(caches[0].numel() // caches.shape[-1], dtype=torch.bool)
    written[rows] = True
    written = written.view(caches.shape[1:-1])  # [B, G, S]: the entries the step's rows write
    assert torch.equal(mine[:, ~written], caches[:, ~written])  # the rest untouched, bit for bit
    torch.testing.assert_close(mine[:, written], theirs[:, written], rtol=tol, atol=tol)
    assert not torch.equal(mine[:, written], caches[:, written])


def test_only_llama_shaped_blocks_are_one_op_and_only_with_the_executors_on():
    from thunder_batch.compile import block_op
    from thunder_batch.compile.project_executor import native_linear
    from thunder_batch.program import StepProgram

    for family, want in [("llama", True), ("pythia", False), ("gemma2", False)]:
        program = StepProgram(tiny_gpt(family), batch_size=2, max_seq_length=32, lane_len=4)
        block_op.mark_blocks(program, False, 2, native_linear)  # without the fusion, or the project's executor
        assert not any(b.one_call for b in program.blocks)
        block_op.mark_blocks(program, True, 2, native_linear)
        native = build.unavailable() is None
        assert [b.one_call for b in program.blocks] == [want and native] * len(program.blocks), family
    gpt = tiny_gpt("llama")  # quantized linears (a GGUF's, a Q4_K_M file's mixed-format qkv) run op by op
    assert quantized.quantize_model(gpt, "q8_0") == 5 * len(gpt.transformer.h) + 1
    qkv = gpt.transformer.h[0].attn.qkv
    gpt.transformer.h[0].attn.qkv = quantized.QuantizedParts([qkv])
    program = StepProgram(gpt, batch_size=2, max_seq_length=32, lane_len=4)
    block_op.mark_blocks(program, True, 2, native_linear)
    assert not any(b.one_call for b in program.blocks)


PROMPTS = mixed_prompts(3, [2, 5, 7])
# One step shape: no prefill lanes (prompts through the decode rows), one rung: every step is decode-only.
CONFIG = dict(batch_size=2, max_seq_length=32, prefill_chunk=4, prefill_lanes=0, attention_lengths=(32,))


@needs_kernels
@pytest.mark.fusion
def test_sliding_window_layers_and_partial_rotary_give_litgpts_tokens_as_one_op(tmp_path):
    """A llama with a 6-token window on every layer (the op reads the window's mask kind) and half of each
    head rotated (the rest passed through), outputs reaching past the window."""
    overrides = dict(sliding_window_size=6, rotary_percentage=0.5)
    engine = Engine(tiny_gpt("llama", **overrides), EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    assert all(b.one_call for b in engine.runner.program.blocks)
    prompts = mixed_prompts(2, [5, 3], seed=5)  # litgpt reads a prompt at most a window long
    got = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=8))]
    assert got == [litgpt_greedy(tiny_gpt("llama", **overrides), p, 8) for p in prompts]


@needs_kernels
@pytest.mark.fusion
def test_qwen2s_qkv_bias_gives_litgpts_tokens_as_one_op(tmp_path):
    """Qwen2.5 (a llama shape with a bias on qkv only), shrunk: its decode blocks are the one op."""
    from litgpt import GPT, Config

    from thunder_batch.bench.parity import random_weights

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=128)
    config = Config.from_name("Qwen2.5-0.5B", **shape, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    gpt = GPT(config)
    random_weights(gpt)
    assert gpt.transformer.h[0].attn.qkv.bias is not None and gpt.transformer.h[0].attn.proj.bias is None
    engine = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    assert all(b.one_call for b in engine.runner.program.blocks)
    got = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))]
    assert got == [litgpt_greedy(gpt, p, 5) for p in PROMPTS]


@needs_kernels
@pytest.mark.fusion
def test_a_compiled_engine_runs_each_decode_block_as_one_op_with_litgpts_tokens_and_loads_it(tmp_path):
    def greedy(engine):
        return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=5))]

    first = Engine(tiny_gpt("llama"), EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    assert greedy(first) == [litgpt_greedy(tiny_gpt("llama"), p, 5) for p in PROMPTS]
    traces = execution_traces(first.runner.step_fn)  # prefix, the block program (layers share it), heads
    block = next(t for t in traces if any(b.sym.name == DECODE_BLOCK for b in t.bound_symbols))
    calls = [b.sym.name for b in block.bound_symbols if b.sym.name not in ("unpack_trivial", "del", "python_return")]
    assert calls == [DECODE_BLOCK], calls  # the block program: one call
    assert first.stats()["stacked_shapes"] == 1  # the decode shape's layers: one native call
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)  # the stored program passes its load-time check
        second = Engine(tiny_gpt("llama"), EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
        assert greedy(second) == greedy(first)
    assert (second.stats()["traced"], second.stats()["stacked_shapes"]) == (0, 1)


@needs_kernels
@pytest.mark.fusion
def test_the_layers_as_one_native_call_follow_a_weight_edited_in_place(tmp_path):
    """Once a shape's layers are settled they run as one native loop (BlockStack); a weight edited in place
    mid-request stops it, the layers' programs pack the weight again, and the loop is made anew. Step by step,
    on shared weights, the tokens are the eager engine's before and after the edit."""
    gpt = tiny_gpt("llama")
    compiled = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    eager = Engine(gpt, EngineConfig(**CONFIG, compile="eager"))
    tokens = {compiled: {}, eager: {}}
    for engine in (compiled, eager):
        for n, prompt in enumerate(PROMPTS[:2]):
            engine.add_request(prompt, SamplingParams(max_new_tokens=14), request_id=n)
    stacks = []
    for step in range(24):
        if step == 12:  # both requests decoding, their layers one native call
            stacks.append(compiled.runner.step_fn._shapes[2, 32].stack)
            with torch.no_grad():
                gpt.transformer.h[1].mlp.fc_2.weight.mul_(-1)
        for engine in (compiled, eager):
            for out in engine.step():
                tokens[engine].setdefault(out.request_id, []).extend(out.token_ids)
        if step == 12:
            stacks.append(compiled.runner.step_fn._shapes[2, 32].stack)
    assert tokens[compiled] == tokens[eager] and [len(t) for t in tokens[eager].values()] == [14, 14]
    assert None not in stacks and stacks[1] is not stacks[0]
    assert not stacks[0].native.current() and stacks[1].native.current()  # the old loop's copy is stale
