"""Tiny litgpt models of several architecture families for the tests, and the greedy oracle."""

from __future__ import annotations

import torch
from litgpt import GPT, Config

from thunder_batch.bench.parity import litgpt_greedy, random_weights

__all__ = [
    "BLOCK",
    "ENGINE_CONFIG",
    "FAMILY_CONFIGS",
    "VOCAB",
    "litgpt_greedy",
    "mixed_prompts",
    "tiny_config",
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
    spec.update(block_size=BLOCK, vocab_size=VOCAB, padded_vocab_size=VOCAB, **overrides)
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


def defaults_without_fusion(real):
    """The default executors minus the Inductor fusion: what in-process test engines run unless a test
    is marked `fusion` (conftest); a test's subprocess that must match them installs it too, with
    `use_defaults_without_fusion()`."""
    from thunder_batch.compile.fusion import EXECUTOR

    return lambda: [ex for ex in real() if ex.name != EXECUTOR]


def use_defaults_without_fusion() -> None:
    from thunder_batch.compile import executors

    executors.default_executors = defaults_without_fusion(executors.default_executors)
