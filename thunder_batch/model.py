"""One step of a litgpt GPT over a flat batch of rows, using the model's own modules and weights.

A step feeds N = B + P*C rows: first one decode row per slot (row b is slot b), then P prefill lanes
of C tokens, each lane bound to one slot. Every row carries its own position and slot; key j is
visible to a row at position p iff j <= p; attention reads the first L cache entries (L from the
`key_pos` input, the smallest rung of a fixed ladder covering every busy position). Linear layers run
on the N rows; decode rows attend over their own slot's cache, a lane over its slot's cache gathered
by slot index. Grouped K/V heads are never copied to every query head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from litgpt.model import apply_rope, apply_rope_interleave, do_softcapping


def check_supported(config) -> None:
    """Refuse litgpt architectures this step does not implement, before anything is traced."""
    if config.latent_attention is not None:
        raise NotImplementedError(f"{config.name}: multi-head latent attention is not supported")
    if config.rope_indices is not None:
        raise NotImplementedError(f"{config.name}: per-layer dual RoPE (rope_indices) is not supported")
    if config.n_expert:
        raise NotImplementedError(f"{config.name}: mixture-of-experts MLPs are not supported")


def visibility_masks(input_pos: torch.Tensor, key_pos: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks over the cache entries read, from positions alone: (global, sliding window), each `[N, L]` bool.
    input_pos: [N]; key_pos: [L] (0 .. L-1)."""
    query_pos = input_pos.unsqueeze(-1)  # [N, 1]
    causal = key_pos <= query_pos  # [N, L]
    window = config.sliding_window_size
    if window is None:  # a distinct tensor all the same: a program may not return one value twice
        return causal, causal.clone()
    return causal, causal & (key_pos > query_pos - window)


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
    # x: [N, heads, D]; cos, sin: [N, n_elem], one position per row
    n_elem = config.rope_n_elem
    rotate = apply_rope_interleave if config.rope_interleave else apply_rope
    roped = rotate(x[..., :n_elem], cos.unsqueeze(1), sin.unsqueeze(1))  # cos as [N, 1, n_elem]
    return torch.cat((roped, x[..., n_elem:]), dim=-1)


def attention_forward(attn, x, cos, sin, mask, input_pos, row_slot, lane_len: int) -> torch.Tensor:
    """litgpt CausalSelfAttention over a step's rows with slot KV caches. x: [N, C] -> [N, C]."""
    cfg = attn.config
    N = x.shape[0]
    H, G, D = cfg.n_head, cfg.n_query_groups, cfg.head_size
    q, k, v = attn.qkv(x).split((H * D, G * D, G * D), dim=-1)  # [N, *]
    if cfg.norm_qk and cfg.norm_qk_type == "olmo2":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = q.view(N, H, D), k.view(N, G, D), v.view(N, G, D)
    if cfg.norm_qk and cfg.norm_qk_type == "default":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k = _rope(q, cos, sin, cfg), _rope(k, cos, sin, cfg)
    cache_k, cache_v = attn.kv_cache(row_slot, input_pos, k, v)  # [B, G, S + 1 + C, D]
    return attn.proj(slot_attention(q, cache_k, cache_v, mask, row_slot, lane_len, cfg))


def slot_attention(q, cache_k, cache_v, mask, row_slot, lane_len: int, config) -> torch.Tensor:
    """Each row against its own slot's first L cache entries. q: [N, H, D]; cache_k/v: [B, G, S', D];
    mask: [N, L]; row_slot: [N] -> [N, H * D]. Rows 0..B-1 decode slot b; the rest are lanes of `lane_len`."""
    B, L = cache_k.shape[0], mask.shape[-1]
    N, H, D = q.shape
    keys, values = cache_k[:, :, :L], cache_v[:, :, :L]  # [B, G, L, D]: the live window only
    decode = grouped_attention(q[:B].unsqueeze(2), keys, values, mask[:B].view(B, 1, 1, L), config)  # [B, 1, H*D]
    if N == B:  # a decode-only step
        return decode.view(B, H * D)
    P = (N - B) // lane_len
    lane_slot = row_slot[B::lane_len]  # [P]: a lane's rows all belong to its slot
    lane_q = q[B:].view(P, lane_len, H, D).transpose(1, 2)  # [P, H, C, D]
    lane_k, lane_v = keys.index_select(0, lane_slot), values.index_select(0, lane_slot)  # [P, G, L, D]
    lane_mask = mask[B:].view(P, 1, lane_len, L)
    lanes = grouped_attention(lane_q, lane_k, lane_v, lane_mask, config)  # [P, C, H*D]
    return torch.cat((decode.view(B, H * D), lanes.reshape(P * lane_len, H * D)))


def block_forward(block, x, cos, sin, masks, input_pos, row_slot, lane_len: int) -> torch.Tensor:
    """litgpt Block.forward (both residual layouts) with our attention. x: [N, C]."""
    cfg = block.config
    mask = masks[1] if block.attn.apply_sliding_window_attention else masks[0]
    x_normed = block.norm_1(x)
    attention = attention_forward(block.attn, x_normed, cos, sin, mask, input_pos, row_slot, lane_len)
    attention_output = block.post_attention_norm(attention)
    if cfg.parallel_residual:
        if not cfg.shared_attention_norm:
            x_normed = block.norm_2(x)
        x = attention_output + x
    else:
        x = attention_output + x
        x_normed = block.norm_2(x)
    return block.post_mlp_norm(block.mlp(x_normed)) + x


def step_inputs(gpt, idx: torch.Tensor, input_pos: torch.Tensor, key_pos: torch.Tensor):
    """What every block reads: x [N, C], cos/sin [N, n_elem], masks (global, window) [N, L].

    Real positions are < S (= gpt.max_seq_length); padding carries a scratch position >= S.
    """
    cfg = gpt.config
    rope_pos = torch.remainder(input_pos, gpt.max_seq_length)  # pads read any valid row
    cos = gpt.cos.index_select(0, rope_pos)  # [N, n_elem]
    sin = gpt.sin.index_select(0, rope_pos)  # [N, n_elem]
    mask_global, mask_window = visibility_masks(input_pos, key_pos, cfg)
    x = gpt.transformer.wte(idx)  # [N, C]
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.n_embd**0.5, dtype=x.dtype)
    return x, cos, sin, mask_global, mask_window
