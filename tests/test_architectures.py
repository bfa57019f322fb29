"""Every litgpt family through the engine against litgpt's own forward pass (docs/DESIGN.md invariant 6).

litgpt's named configs are grouped by the architecture flags the step program branches on
(`helpers.litgpt_families`: 23 groups in litgpt 0.5.13, from Pythia to Gemma-3 and the Mixtral and
Qwen3 mixtures of experts); each group's first config, shrunk with the same flags, runs mixed-length
prompts through the eager engine, and a smaller set (the MoE and Gemma-3 ones) through Thunder.
User configs no named config has (YaRN's mscale; litgpt's grouped MoE router with shared experts,
a first dense layer, routed scaling and biases) run too. The oracle is one uncached litgpt forward
over prompt + output per request: no KV-cache path of litgpt's is trusted.
"""

from __future__ import annotations

import pytest
import torch
from litgpt import GPT, Config
from litgpt.config import configs as litgpt_configs
from litgpt.model import LLaMAMoE

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.model import check_supported
from thunder_batch.moe import LAYOUTS, StackedExperts, layout_for

from helpers import (
    ENGINE_CONFIG,
    architecture,
    assert_litgpt_greedy,
    litgpt_families,
    mixed_prompts,
    shrunk_config,
    tiny_family_gpt,
)

FAMILIES = litgpt_families()  # first config name -> every named config with its flags
YARN = dict(factor=4.0, beta_fast=32, beta_slow=1, original_max_seq_len=32, mscale=1.0, mscale_all_dim=0.5)
# litgpt's grouped top-k router (sigmoid scores, groups), a shared expert, a dense first layer, biases
GROUPED_ROUTER = dict(
    n_layer=3,
    first_k_dense_replace=1,
    n_shared_expert=1,
    n_expert_groups=4,
    n_topk_groups=2,
    n_topk_scores_per_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    bias=True,
)
USER_CONFIGS = {
    # YaRN RoPE: litgpt scales the softmax by mscale(factor, mscale_all_dim)^2 and cos/sin by mscale ratios
    "yarn-mscale": lambda: shrunk_config("Llama-3.1-8B", rope_adjustments=YARN),
    # experts 18 wide: rows of 72 bytes, which torch's grouped matmul refuses, so the step gathers
    # each row's experts in decode-only steps (4 rows x 4 < 32 experts) and runs them dense with lanes
    "moe-grouped-router": lambda: shrunk_config("Qwen3-30B-A3B", **GROUPED_ROUTER, moe_intermediate_size=18),
}
# Under Thunder: the MoE families and the fallback layouts (one block trace for every MoE layer) and
# both Gemma-3 kinds (a block program per kind of layer: 5 local layers, then a global one).
THUNDER = {
    "Qwen3-30B-A3B": [0, 0],
    "Mixtral-8x7B-v0.1": [0, 0],
    "moe-grouped-router": [0, 1, 1],
    "Gemma-3-1b-it": [0, 0, 0, 0, 0, 1],
    "Gemma-3-4b-it": [0, 0, 0, 0, 0, 1],
}
# 1 token up to about 4 chunks of 8; 6 prompts through 4 slots, so slots are reused
LENGTHS = [1, 5, 9, 17, 30, 3]
MAX_NEW = 6


def config_for(case: str) -> Config:
    return USER_CONFIGS[case]() if case in USER_CONFIGS else shrunk_config(case)


def run_against_litgpt(case: str, compile: str) -> Engine:
    config = config_for(case)
    prompts = mixed_prompts(len(LENGTHS), LENGTHS)
    engine = Engine(tiny_family_gpt(config), EngineConfig(compile=compile, **ENGINE_CONFIG))
    results = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [len(r.token_ids) for r in results] == [MAX_NEW] * len(prompts)
    assert_litgpt_greedy(tiny_family_gpt(config), prompts, results)
    return engine


@pytest.mark.parametrize("case", [*FAMILIES, *USER_CONFIGS])
def test_eager_engine_matches_litgpt(case):
    if case in FAMILIES:  # the shrunk model still takes every code path of its family
        assert architecture(config_for(case)) == architecture(Config.from_name(case))
    run_against_litgpt(case, "eager")


def block_programs(engine: Engine) -> dict[tuple[int, int], list[int]]:
    """Per step shape, which distinct block computation runs each layer (0, 1, ... in order of use)."""
    out = {}
    for shape, programs in engine.runner.step_fn._shapes.items():
        ids = [id(programs.blocks[i].computation) for i in range(len(programs.blocks))]
        out[shape] = [list(dict.fromkeys(ids)).index(i) for i in ids]
    return out


@pytest.mark.regression
@pytest.mark.parametrize("case", list(THUNDER))
def test_thunder_engine_matches_litgpt(case):
    engine = run_against_litgpt(case, "thunder")
    programs = block_programs(engine)  # decode-only and 2-lane steps with this traffic
    assert len(programs) >= 2 and all(layers == THUNDER[case] for layers in programs.values())
    # one block program per kind of layer per shape, whatever the routing: never a retrace
    assert engine.runner.step_fn.traced["block"] == len(programs) * (1 + max(THUNDER[case]))


MOE_UNITS = {
    "Qwen3-30B-A3B": (),
    "Mixtral-8x7B-v0.1": (),
    "grouped-router": tuple(GROUPED_ROUTER.items()),
}


@torch.no_grad()
@pytest.mark.parametrize("case", list(MOE_UNITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_moe_layout_equals_litgpts_moe(case, dtype):
    """Each layout at every row count against litgpt's LLaMAMoE (data-dependent shapes) on the same
    weights; litgpt's own module gives the same output before and after its experts are stacked."""
    name = "Qwen3-30B-A3B" if case == "grouped-router" else case
    config = shrunk_config(name, **dict(MOE_UNITS[case]))
    gpt = tiny_family_gpt(config).to(dtype)
    moe = next(block.mlp for block in gpt.transformer.h if isinstance(block.mlp, LLaMAMoE))
    x = torch.randn(40, config.n_embd, generator=torch.Generator().manual_seed(0)).to(dtype)
    before = moe(x.unsqueeze(0))[0]
    stacked = {layout: StackedExperts(moe, layout) for layout in LAYOUTS}
    assert torch.equal(moe(x.unsqueeze(0))[0], before)
    last = stacked[LAYOUTS[-1]]  # the experts' weights now live in the last stack made: no second copy
    assert moe.experts[1].fc_2.weight.untyped_storage().data_ptr() == last.fc.untyped_storage().data_ptr()
    assert last.grouped_runs  # so "grouped" below is the layout the step runs here
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for rows in (1, 3, 8, 40):
        want = moe(x[:rows].unsqueeze(0))[0]
        for layout, module in stacked.items():
            torch.testing.assert_close(module(x[:rows]), want, **tolerance, msg=f"{layout} at {rows} rows")


@torch.no_grad()
def test_stacked_experts_leave_the_callers_model_as_it_was_and_share_its_weights():
    """Invariant 14 for an MoE model: the experts' weights move into one stack per layer (same Parameter
    objects, values and layout: litgpt's own forward is bit-identical), and an in-place edit of an
    expert's weight still reaches the engine."""
    gpt = tiny_family_gpt(config_for("Qwen3-30B-A3B"))
    prompt = mixed_prompts(1, [9])[0]
    params, state = list(gpt.parameters()), {k: v.clone() for k, v in gpt.state_dict().items()}
    forward_before = gpt(torch.tensor([prompt]))
    engine = Engine(gpt, EngineConfig(compile="eager", **ENGINE_CONFIG))
    first = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert list(gpt.parameters()) == params and all(torch.equal(v, gpt.state_dict()[k]) for k, v in state.items())
    assert torch.equal(gpt(torch.tensor([prompt])), forward_before)
    for block in gpt.transformer.h:
        for expert in block.mlp.experts:
            expert.proj.weight.mul_(-1)  # every expert's output flips sign
    second = engine.generate([prompt], SamplingParams(max_new_tokens=4))
    assert first[0].token_ids != second[0].token_ids
    assert_litgpt_greedy(gpt, [prompt], second)


def test_layout_follows_shapes_only():
    """grouped wherever torch runs it; else gathered while the rows' expert choices are fewer than the
    experts, dense from there on."""
    assert {layout_for(rows, 128, 8, grouped_runs=True) for rows in (1, 8, 64)} == {"grouped"}
    assert [layout_for(rows, 128, 8, False) for rows in (1, 8, 15, 16, 64)] == ["gathered"] * 3 + ["dense"] * 2
    assert [layout_for(rows, 8, 2, False) for rows in (1, 3, 4, 64)] == ["gathered"] * 2 + ["dense"] * 2
    config = shrunk_config("Qwen3-30B-A3B")
    assert StackedExperts(tiny_family_gpt(config).transformer.h[0].mlp).grouped_runs  # CPU: float32 too
    odd = config_for("moe-grouped-router")  # 18 wide: not 16-byte strides
    assert not StackedExperts(tiny_family_gpt(odd).transformer.h[1].mlp).grouped_runs


def test_every_named_config_is_accepted():
    """check_supported refuses only what the step cannot run; no litgpt 0.5.13 named config is refused."""
    for spec in litgpt_configs:
        check_supported(Config(**spec))
    assert sum(len(names) for names in FAMILIES.values()) == len(litgpt_configs)


def test_thunder_runs_the_grouped_matmul_where_torch_and_inductor_do():
    """The compat fix: Thunder's torch executor claims `_grouped_mm` in any dtype (with int32 group
    ends), its torchcompile executor in bfloat16 only; applying it again changes nothing."""
    from thunder_batch._compat import import_thunder, patch_thunder_grouped_mm

    import_thunder()
    assert patch_thunder_grouped_mm() == []
    import thunder.torch as ltorch
    from thunder.executors import torch_compile, torchex

    def claims(executor, dtype) -> bool:
        a, b = torch.zeros(4, 16, dtype=dtype), torch.zeros(2, 16, 16, dtype=dtype)
        trace = thunder_trace(lambda a, b, ends: torch._grouped_mm(a, b, ends), a, b, torch.tensor([1, 4]).int())
        bsym = next(b for b in trace.bound_symbols if b.sym.id == ltorch._grouped_mm.id)
        return executor.can_execute(bsym)

    assert claims(torchex.ex, torch.float32) and claims(torchex.ex, torch.bfloat16)
    assert claims(torch_compile.torch_compile_ex, torch.bfloat16)
    assert not claims(torch_compile.torch_compile_ex, torch.float32)


def thunder_trace(fn, *args):
    """Thunder's first (unclaimed) trace of `fn` on `args`."""
    from thunder_batch._compat import import_thunder

    thunder = import_thunder()
    jitted = thunder.jit(fn)
    jitted(*args)
    return thunder.last_traces(jitted)[0]


def test_latent_attention_is_refused_before_any_step():
    latent = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    config = shrunk_config("Llama-3.1-8B", n_query_groups=4, latent_attention=latent)
    with pytest.raises(NotImplementedError, match="multi-head latent attention is not supported"):
        Engine(GPT(config), EngineConfig(compile="thunder", **ENGINE_CONFIG))


def test_rope_indices_without_a_local_base_are_refused():
    config = shrunk_config("Llama-3.1-8B", rope_indices=[0, 1])
    with pytest.raises(ValueError, match="rope_indices needs rope_local_base_freq"):
        Engine(GPT(config), EngineConfig(compile="eager", **ENGINE_CONFIG))
