"""One step of a litgpt GPT with per-slot positions, using the model's own modules and weights.

Differences from `GPT.forward` that batching needs: positions are `[B, T]` (each slot its own),
the mask follows from positions alone (key j visible to query i iff j <= pos_i), the KV cache is
a `SlotKVCache`, and grouped K/V heads are never copied to every query head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from litgpt.model import apply_rope, apply_rope_interleave, do_softcapping

from thunder_batch.index_ops import index_select_2d


def check_supported(config) -> None:
    """Refuse litgpt architectures this step does not implement, before anything is traced."""
    if config.latent_attention is not None:
        raise NotImplementedError(f"{config.name}: multi-head latent attention is not supported")
    if config.rope_indices is not None:
        raise NotImplementedError(f"{config.name}: per-layer dual RoPE (rope_indices) is not supported")
    if config.n_expert:
        raise NotImplementedError(f"{config.name}: mixture-of-experts MLPs are not supported")


def visibility_masks(input_pos: torch.Tensor, cache_len: int, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks over the cache from positions alone: (global, sliding window), each `[B, 1, T, L]` bool."""
    key_pos = torch.arange(cache_len, device=input_pos.device)  # [L]
    query_pos = input_pos.unsqueeze(-1)  # [B, T, 1]
    causal = key_pos <= query_pos  # [B, T, L]
    window = config.sliding_window_size
    windowed = causal & (key_pos > query_pos - window) if window is not None else causal
    return causal.unsqueeze(1), windowed.unsqueeze(1)


def grouped_attention(q, k, v, mask, config) -> torch.Tensor:
    """Attention for H query heads over G shared K/V heads without repeating K/V.

    q: [B, H, T, D], k, v: [B, G, L, D], mask: [B, 1, T, L] bool -> [B, T, H * D].
    The H/G query heads of a group fold into the query-length dim, so each group is one
    attention against its own un-copied K/V (head h uses group h // (H/G), as litgpt does).
    """
    B, H, T, D = q.shape
    G = k.shape[1]
    q_per_kv = H // G
    q = q.reshape(B, G, q_per_kv * T, D)  # [B, G, (H/G)*T, D]
    mask = mask.repeat(1, 1, q_per_kv, 1)  # [B, 1, (H/G)*T, L]
    scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)
    if config.attention_logit_softcapping is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = do_softcapping(q @ k.mT * scale, config.attention_logit_softcapping)  # [B, G, (H/G)*T, L]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        y = F.softmax(scores, dim=-1, dtype=torch.float).to(q.dtype) @ v
    # [B, G, (H/G)*T, D] -> [B, H, T, D] -> [B, T, H*D]
    return y.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config) -> torch.Tensor:
    n_elem = config.rope_n_elem
    rotate = apply_rope_interleave if config.rope_interleave else apply_rope
    return torch.cat((rotate(x[..., :n_elem], cos, sin), x[..., n_elem:]), dim=-1)


def attention_forward(attn, x, cos, sin, mask, input_pos) -> torch.Tensor:
    """litgpt CausalSelfAttention with a slot KV cache. x: [B, T, C] -> [B, T, C]."""
    cfg = attn.config
    B, T, _ = x.shape
    H, G, D = cfg.n_head, cfg.n_query_groups, cfg.head_size
    q, k, v = attn.qkv(x).split((H * D, G * D, G * D), dim=-1)  # [B, T, *]
    if cfg.norm_qk and cfg.norm_qk_type == "olmo2":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q = q.view(B, T, H, D).transpose(1, 2)  # [B, H, T, D]
    k = k.view(B, T, G, D).transpose(1, 2)  # [B, G, T, D]
    v = v.view(B, T, G, D).transpose(1, 2)  # [B, G, T, D]
    if cfg.norm_qk and cfg.norm_qk_type == "default":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k = _rope(q, cos, sin, cfg), _rope(k, cos, sin, cfg)
    k, v = attn.kv_cache(input_pos, k, v)  # [B, G, L, D]
    return attn.proj(grouped_attention(q, k, v, mask, cfg))


def block_forward(block, x, cos, sin, masks, input_pos) -> torch.Tensor:
    """litgpt Block.forward (both residual layouts) with our attention. x: [B, T, C]."""
    cfg = block.config
    mask = masks[1] if block.attn.apply_sliding_window_attention else masks[0]
    x_normed = block.norm_1(x)
    attention_output = block.post_attention_norm(attention_forward(block.attn, x_normed, cos, sin, mask, input_pos))
    if cfg.parallel_residual:
        if not cfg.shared_attention_norm:
            x_normed = block.norm_2(x)
        x = attention_output + x
    else:
        x = attention_output + x
        x_normed = block.norm_2(x)
    return block.post_mlp_norm(block.mlp(x_normed)) + x


def step_inputs(gpt, idx: torch.Tensor, input_pos: torch.Tensor, cache_len: int):
    """What every block reads: x [B, T, C], cos/sin [B, T, n_elem], masks (global, window) [B, 1, T, L].

    Real positions are < S (= gpt.max_seq_length); padding carries S + t, its scratch cache entry.
    """
    cfg = gpt.config
    rope_pos = torch.remainder(input_pos, gpt.max_seq_length)  # pads read any valid row
    cos = index_select_2d(gpt.cos, 0, rope_pos)  # [B, T, n_elem]
    sin = index_select_2d(gpt.sin, 0, rope_pos)  # [B, T, n_elem]
    mask_global, mask_window = visibility_masks(input_pos, cache_len, cfg)
    x = gpt.transformer.wte(idx)  # [B, T, C]
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.n_embd**0.5, dtype=x.dtype)
    return x, cos, sin, mask_global, mask_window


def forward_hidden(gpt, idx: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """Final-norm hidden states of every position for one step. idx, input_pos: [B, T] -> [B, T, C]."""
    cache_len = gpt.transformer.h[0].attn.kv_cache.k.shape[2]
    x, cos, sin, *masks = step_inputs(gpt, idx, input_pos, cache_len)
    for block in gpt.transformer.h:
        x = block_forward(block, x, cos, sin, masks, input_pos)
    return gpt.transformer.ln_f(x)
