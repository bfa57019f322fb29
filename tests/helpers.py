"""Tiny litgpt models of several architecture families for the tests, and the greedy oracles.

`FAMILY_CONFIGS`: hand-made tiny configs of a few families (most tests). `litgpt_families()`: every
named litgpt config grouped by the architecture flags the step program branches on, and
`shrunk_config` / `tiny_family_gpt`: one group's first config shrunk to a tiny random model with the
same flags (tests/test_architectures.py runs every group).
"""

from __future__ import annotations

import pytest
import torch
from litgpt import GPT, Config
from litgpt.config import configs as litgpt_configs

from thunder_batch.bench.parity import litgpt_greedy, random_weights

__all__ = [
    "BLOCK",
    "ENGINE_CONFIG",
    "FAMILY_CONFIGS",
    "VOCAB",
    "architecture",
    "assert_litgpt_greedy",
    "litgpt_families",
    "litgpt_greedy",
    "mixed_prompts",
    "shrunk_config",
    "tiny_config",
    "tiny_family_gpt",
    "tiny_gpt",
]

VOCAB = 256
BLOCK = 128

# Gemma-2: attention and final logit softcapping, post-attention/post-MLP norms, scaled embeddings,
# GeGLU, alternating sliding-window layers (a window longer than the tiny models' block), attention_scores_scalar
GEMMA2 = dict(
    name="gemma-2-2b",
    n_layer=2,
    n_embd=64,
    n_head=4,
    n_query_groups=2,
    head_size=16,
    intermediate_size=128,
    attention_scores_scalar=16,
)

# One config per family: each exercises different litgpt code paths in the step program.
FAMILY_CONFIGS = {
    # GPT-NeoX/Pythia: parallel residual, partial rotary (25%), LayerNorm, biases, MHA
    "pythia": dict(name="pythia-14m", n_layer=2),
    # Llama: RMSNorm, SwiGLU, grouped-query attention (4 query heads over 2 KV heads)
    "llama": dict(
        name="SmolLM2-135M", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16, intermediate_size=128
    ),
    "gemma2": GEMMA2,
    # Gemma-2 with a window short enough to bite: layers alternate sliding-window and global attention
    "gemma2_window": dict(GEMMA2, n_layer=4, sliding_window_size=6),
    # Phi-2: parallel residual with a shared attention norm, partial rotary, GELU MLP
    "phi2": dict(name="phi-2", n_layer=2, n_embd=64, n_head=4, n_query_groups=4, head_size=16, intermediate_size=128),
}


def tiny_config(family: str, **overrides) -> Config:
    spec = dict(FAMILY_CONFIGS[family])
    name = spec.pop("name")
    spec.update(block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    spec.update(overrides)
    return Config.from_name(name, **spec)


def tiny_gpt(family: str, seed: int = 0, **overrides) -> GPT:
    """A random GPT whose logits are O(1) apart, so greedy choices are not float-noise ties."""
    torch.manual_seed(seed)
    gpt = GPT(tiny_config(family, **overrides))
    random_weights(gpt)
    return gpt.eval()


def mixed_prompts(n: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


ENGINE_CONFIG = dict(batch_size=4, max_seq_length=64, prefill_chunk=8)


# -- every litgpt family ------------------------------------------------------------------------


def _rope_kind(cfg: Config) -> str | None:
    adjustments = cfg.rope_adjustments or {}
    if "beta_fast" in adjustments:
        return "yarn+mscale" if adjustments.get("mscale_all_dim") else "yarn"
    if "low_freq_factor" in adjustments:
        return "llama3"
    return "linear" if "factor" in adjustments else None


def _layer_kinds(cfg: Config) -> list[tuple]:
    """Per layer: what makes its block differ from others (window, RoPE table, dense MLP in an MoE model)."""
    window = cfg.sliding_window_indices if cfg.sliding_window_size is not None else [0] * cfg.n_layer
    rope = cfg.rope_indices or [0] * cfg.n_layer
    dense = [i < (cfg.first_k_dense_replace or 0) for i in range(cfg.n_layer)]
    return list(zip(window[: cfg.n_layer], rope[: cfg.n_layer], dense))


def architecture(cfg: Config) -> tuple:
    """The flags of a litgpt Config that choose a code path in litgpt's forward or in the step program."""
    H, G = cfg.n_head, cfg.n_query_groups
    flags = dict(
        norm=cfg.norm_class_name,
        mlp=cfg.mlp_class_name,
        gelu=cfg.gelu_approximate,
        parallel_residual=cfg.parallel_residual,
        shared_attention_norm=cfg.shared_attention_norm,
        norm_1=cfg.norm_1,
        norm_2=cfg.norm_2,
        norm_qk=cfg.norm_qk and cfg.norm_qk_type,
        post_attention_norm=cfg.post_attention_norm,
        post_mlp_norm=cfg.post_mlp_norm,
        bias=cfg.bias,
        attn_bias=cfg.attn_bias,
        lm_head_bias=cfg.lm_head_bias,
        heads="MHA" if G == H else "MQA" if G == 1 else "GQA",
        partial_rotary=cfg.rotary_percentage < 1,
        rope_interleave=cfg.rope_interleave,
        rope=_rope_kind(cfg),
        rope_condense=cfg.rope_condense_ratio != 1,
        dual_rope=cfg.rope_local_base_freq is not None,
        layer_kinds=len(set(_layer_kinds(cfg))),
        sliding_window=cfg.sliding_window_size is not None,
        attention_softcapping=cfg.attention_logit_softcapping is not None,
        final_softcapping=cfg.final_logit_softcapping is not None,
        scale_embeddings=cfg.scale_embeddings,
        attention_scores_scalar=cfg.attention_scores_scalar is not None,
        shared_experts=bool(cfg.n_shared_expert),
        expert_groups=bool(cfg.n_expert_groups),
        routed_scaling=cfg.routed_scaling_factor != 1.0,
        latent_attention=cfg.latent_attention is not None,
    )
    return tuple(sorted(flags.items()))


def litgpt_families() -> dict[str, list[str]]:
    """Every named litgpt config, grouped by `architecture`: first name of the group -> all its names."""
    groups: dict[tuple, list[str]] = {}
    for spec in litgpt_configs:
        groups.setdefault(architecture(Config(**spec)), []).append(spec["name"])
    return {names[0]: names for names in groups.values()}


def shrunk_config(name: str, **overrides) -> Config:
    """litgpt's config `name` at test size with the same `architecture`: 4 query heads of 16 over as
    many KV groups as its kind (MHA 4, GQA 2, MQA 1), at most 32 experts (4 per token), windows of 6
    positions, and enough layers to hold every kind of layer it has (Gemma-3: 5 local, then global)."""
    cfg = Config.from_name(name)
    kinds = _layer_kinds(cfg)
    n_layer = max(2, 1 + max(kinds.index(kind) for kind in set(kinds)))
    G = {"MHA": 4, "GQA": 2, "MQA": 1}[dict(architecture(cfg))["heads"]]
    spec = dict(n_layer=n_layer, n_embd=64, n_head=4, n_query_groups=G, head_size=16, intermediate_size=128)
    spec.update(block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB)
    if cfg.attention_scores_scalar is not None:
        spec["attention_scores_scalar"] = 16
    if cfg.sliding_window_size is not None:
        spec["sliding_window_size"] = 6  # shorter than the prompts: the window bites
    if cfg.n_expert:
        spec.update(n_expert=min(cfg.n_expert, 32), n_expert_per_token=min(cfg.n_expert_per_token, 4))
        if cfg.moe_intermediate_size:
            spec["moe_intermediate_size"] = 32
        else:
            spec["intermediate_size"] = 64  # Mixtral's experts take intermediate_size
    spec.update(overrides)
    return Config.from_name(name, **spec)


def tiny_family_gpt(config: Config, seed: int = 0) -> GPT:
    """A random GPT of `config` (see `tiny_gpt`)."""
    torch.manual_seed(seed)
    gpt = GPT(config)
    random_weights(gpt)
    return gpt.eval()


@torch.no_grad()
def assert_litgpt_greedy(gpt, prompts: list[list[int]], results, logprob_atol: float = 1e-4) -> None:
    """Each result is litgpt's greedy continuation of its prompt, checked with one uncached litgpt
    forward pass over every prompt + output (right-padded: causal, so padding never reaches a real
    position; no KV-cache path of litgpt's is trusted): every output token is the argmax of litgpt's
    logits one position earlier (so, by induction, the greedy sequence) and its logprob is litgpt's."""
    sequences = [prompt + result.token_ids[:-1] for prompt, result in zip(prompts, results)]
    batch = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    for i, seq in enumerate(sequences):
        batch[i, : len(seq)] = torch.tensor(seq)
    all_logits = gpt(batch).float()  # [R, T, V]
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        logits = all_logits[i, len(prompt) - 1 : len(sequences[i])]  # [out, V]
        want = logits.argmax(-1)
        first = next((j for j, (a, b) in enumerate(zip(want.tolist(), result.token_ids)) if a != b), None)
        if first is not None:
            raise AssertionError(f"prompt of {len(prompt)}: output token {first} differs from litgpt's greedy choice")
        want_logprob = torch.log_softmax(logits, -1).gather(1, want.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(result.logprobs), want_logprob, rtol=0, atol=logprob_atol)


def defaults_without_fusion(real):
    """The default executors minus the Inductor fusion: what in-process test engines run unless a test
    is marked `fusion` (conftest); a test's subprocess that must match them installs it too, with
    `use_defaults_without_fusion()`."""
    from thunder_batch.compile.fusion import EXECUTOR

    return lambda: [ex for ex in real() if ex.name != EXECUTOR]


def use_defaults_without_fusion() -> None:
    from thunder_batch.compile import executors

    executors.default_executors = defaults_without_fusion(executors.default_executors)


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU: torch.cuda.is_available() is False here"
)


def kv_buffers(engine) -> list:
    """Every layer's K and V cache buffer of an engine."""
    return [t for cache in engine.runner.caches for t in (cache.k, cache.v)]
