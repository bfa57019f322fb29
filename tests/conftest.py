"""Tiny litgpt models of several architecture families, and litgpt's own generate_fn as the oracle."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from litgpt import GPT, Config
from litgpt.generate.base import generate_fn

VOCAB = 256
BLOCK = 128

# One config per family: each exercises different litgpt code paths in the step program.
FAMILY_CONFIGS = {
    # GPT-NeoX/Pythia: parallel residual, partial rotary (25%), LayerNorm, biases, MHA
    "pythia": dict(name="pythia-14m", n_layer=2),
    # Llama: RMSNorm, SwiGLU, grouped-query attention (4 query heads over 2 KV heads)
    "llama": dict(name="SmolLM2-135M", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                  intermediate_size=128),
    # Gemma-2: attention and final logit softcapping, post-attention/post-MLP norms, scaled
    # embeddings, GeGLU, alternating sliding-window layers, attention_scores_scalar
    "gemma2": dict(name="gemma-2-2b", n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                   intermediate_size=128, attention_scores_scalar=16),
    # Gemma-2 with a window short enough to bite: layers alternate sliding-window and global attention
    "gemma2_window": dict(name="gemma-2-2b", n_layer=4, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                          intermediate_size=128, attention_scores_scalar=16, sliding_window_size=6),
    # Phi-2: parallel residual with a shared attention norm, partial rotary, GELU MLP
    "phi2": dict(name="phi-2", n_layer=2, n_embd=64, n_head=4, n_query_groups=4, head_size=16,
                 intermediate_size=128),
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
    with torch.no_grad():
        for p in gpt.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return gpt.eval()


def litgpt_greedy(gpt: GPT, prompt: list[int], max_new_tokens: int, stop_tokens=()) -> list[int]:
    """litgpt's own single-prompt generate_fn: the oracle for batching.

    For attention softcapping (Gemma-2) litgpt 0.5.13's KV-cache path is wrong: it adds the boolean
    cache mask to the scores (+1/+0) instead of masking, so there the oracle is litgpt's uncached
    full forward, re-run on the whole sequence for every token.
    """
    if gpt.config.attention_logit_softcapping is not None:
        assert not stop_tokens
        return litgpt_greedy_uncached(gpt, prompt, max_new_tokens)
    model = copy.deepcopy(gpt)
    model.set_kv_cache(batch_size=1, max_seq_length=len(prompt) + max_new_tokens)
    out = generate_fn(model, torch.tensor(prompt), len(prompt) + max_new_tokens, temperature=0.0,
                      stop_tokens=stop_tokens, include_prompt=False, include_eos=False)
    return [int(t) for t in out]


@torch.no_grad()
def litgpt_greedy_uncached(gpt: GPT, prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(int(gpt(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt):]


def mixed_prompts(n: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(autouse=True, scope="session")
def fresh_compile_cache(tmp_path_factory):
    """Every test session compiles into its own cache dir, never the user's ./compile_cache: tests
    that count traces or inspect them must see this session's programs."""
    import os

    previous = os.environ.get("THUNDER_BATCH_CACHE_DIR")
    os.environ["THUNDER_BATCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile_cache"))
    yield
    if previous is None:
        os.environ.pop("THUNDER_BATCH_CACHE_DIR")
    else:
        os.environ["THUNDER_BATCH_CACHE_DIR"] = previous


ENGINE_CONFIG = dict(batch_size=4, max_seq_length=64, prefill_chunk=8)


@pytest.fixture(scope="session")
def thunder_engine():
    """Thunder engines shared across tests (tracing is the slow part): family -> Engine built on
    `tiny_gpt(family)` with ENGINE_CONFIG. Tests must leave every slot free."""
    from thunder_batch import Engine, EngineConfig

    engines = {}

    def get(family: str) -> Engine:
        if family not in engines:
            engines[family] = Engine(tiny_gpt(family), EngineConfig(compile="thunder", **ENGINE_CONFIG))
        assert not engines[family].has_unfinished()
        return engines[family]

    return get


@pytest.fixture(params=list(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param
