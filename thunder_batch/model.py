"""One step of a litgpt GPT over a flat batch of rows, using the model's own modules and weights.

A step feeds N = B + P*C rows: first one decode row per slot (row b is slot b), then P prefill lanes
of C tokens, each lane bound to one slot. Every row carries its own position and slot; key j is
visible to a row at position p iff j <= p; attention reads the first L cache entries (L from the
`key_pos` input, the smallest rung of a fixed ladder covering every busy position). Linear layers run
on the N rows; decode rows attend over their own slot's cache, a lane over its slot's cache gathered
by slot index. Grouped K/V heads are never copied to every query head.

What is the same for every layer is made once per step by `step_inputs` (`StepShared`): the RoPE
rows, the KV write's flat row indices, the attention masks already in the layout attention takes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from litgpt.model import apply_rope, apply_rope_interleave, do_softcapping, yarn_get_mscale
from torch.overrides import handle_torch_function, has_torch_function

from thunder_batch.index_ops import flat_rows, index_copy_flat, index_select_2d


def check_supported(config) -> None:
    """Refuse litgpt architectures this step does not implement, before anything is traced."""
    if config.latent_attention is not None:
        raise NotImplementedError(f"{config.name}: multi-head latent attention is not supported")
    if config.rope_indices is not None and config.rope_local_base_freq is None:
        # litgpt builds the second (local) RoPE table only from rope_local_base_freq
        raise ValueError(f"{config.name}: rope_indices needs rope_local_base_freq (the local layers' RoPE base)")


def attention_scale(config) -> float:
    """litgpt's softmax scale: 1/sqrt(attention_scores_scalar or head_size), times YaRN's mscale squared
    (CausalSelfAttention.mscale: set by rope_adjustments' `factor` and `mscale_all_dim`)."""
    scale = 1.0 / math.sqrt(config.attention_scores_scalar or config.head_size)
    adjustments = config.rope_adjustments or {}
    if adjustments.get("mscale_all_dim") and adjustments.get("factor"):  # YaRN, as litgpt's attention
        mscale = yarn_get_mscale(adjustments["factor"], adjustments["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


def rope_table(config, block_idx: int) -> int | None:
    """Which of the two RoPE tables layer `block_idx` reads (Gemma-3: 0 global, 1 local), or None when
    the model has one. With two, litgpt's tables are `[S, n_elem, 2]` (build_rope_cache)."""
    return None if config.rope_indices is None else config.rope_indices[block_idx]


def layer_rope(cos: torch.Tensor, sin: torch.Tensor, table: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cos/sin `[N, 1, n_elem]` from the step's (`[N, 1, n_elem]`, or `[N, 1, n_elem, 2]`)."""
    return (cos, sin) if table is None else (cos[..., table], sin[..., table])


class StepShared(NamedTuple):
    """What every block of one step reads besides x (K mask kinds: global, then sliding window if any).
    Passed to the blocks as plain tensors, in this order."""

    cos: torch.Tensor  # [N, 1, n_elem] each row's RoPE (one head dim to broadcast over); [..., 2] with
    sin: torch.Tensor  # [N, 1, n_elem]   rope_indices: both tables, each block takes its own (layer_rope)
    kv_rows: torch.Tensor  # [N * G] rows each (row, K/V head) writes in a cache seen as [B * G * S', D]
    decode_mask: torch.Tensor  # [K, B, 1, 1, L] additive (0 / lowest) in the model dtype
    lane_slot: torch.Tensor  # [P] the slot each lane reads ([0]: a decode-only step)
    lane_mask: torch.Tensor  # [K, P, 1, (H/G)*C, L] additive, already in the folded-head layout


def visibility_masks(input_pos: torch.Tensor, key_pos: torch.Tensor, config) -> list[torch.Tensor]:
    """Masks over the cache entries read, from positions alone: [global, sliding window (if any)],
    each `[N, L]` bool. input_pos: [N]; key_pos: [L] (0 .. L-1)."""
    query_pos = input_pos.unsqueeze(-1)  # [N, 1]
    causal = key_pos <= query_pos  # [N, L]
    window = config.sliding_window_size
    return [causal] if window is None else [causal, causal & (key_pos > query_pos - window)]


def step_inputs(gpt, rope: tuple, cache_shape, idx, input_pos, row_slot, key_pos, lane_len: int):
    """x [N, C] and the StepShared tensors of one step. rope: (cos, sin) tables [S, n_elem] ([S, n_elem, 2]
    with rope_indices);
    cache_shape: every layer's cache [B, G, S', D]. Real positions are < S; padding carries a
    scratch position >= S (its RoPE row is any valid one: the result is never read)."""
    cfg = gpt.config
    B, N, L = cache_shape[0], idx.shape[0], key_pos.shape[0]
    rope_pos = torch.remainder(input_pos, rope[0].shape[0]).view(1, N)
    cos, sin = (index_select_2d(table, 0, rope_pos).view(N, 1, *table.shape[1:]) for table in rope)  # [N, 1, n_elem]
    x = gpt.transformer.wte(idx)  # [N, C]
    if cfg.scale_embeddings:
        x = x * torch.tensor(cfg.n_embd**0.5, dtype=x.dtype)
    kv_rows = flat_rows(cache_shape, 2, row_slot, input_pos)  # [N * G]
    visible = torch.stack(visibility_masks(input_pos, key_pos, cfg))  # [K, N, L]
    # Additive, with the dtype's lowest value rather than -inf: a fully masked padding row stays finite.
    additive = torch.zeros_like(visible, dtype=x.dtype).masked_fill(~visible, torch.finfo(x.dtype).min)
    K, P, q_per_kv = additive.shape[0], (N - B) // lane_len, cfg.n_head // cfg.n_query_groups
    decode_mask = additive[:, :B].reshape(K, B, 1, 1, L)
    lane_mask = additive[:, B:].reshape(K, P, 1, 1, lane_len, L).expand(K, P, 1, q_per_kv, lane_len, L)
    lane_mask = lane_mask.reshape(K, P, 1, q_per_kv * lane_len, L)  # head j of a group, token t: row j*C + t
    lane_slot = row_slot[B::lane_len]  # [P]: a lane's rows all belong to its slot
    return x, StepShared(cos, sin, kv_rows, decode_mask, lane_slot, lane_mask)


def grouped_attention(q, k, v, mask, config) -> torch.Tensor:
    """Attention for H query heads over G shared K/V heads without repeating K/V.

    q: [B, H, T, D], k, v: [B, G, L, D], mask: additive, broadcastable to [B, 1, (H/G)*T, L] -> [B, T, H * D].
    The H/G query heads of a group fold into the query-length dim, so each group is one
    attention against its own un-copied K/V (head h uses group h // (H/G), as litgpt does).
    """
    B, H, T, D = q.shape
    G = k.shape[1]
    q = q.reshape(B, G, (H // G) * T, D)  # [B, G, (H/G)*T, D]
    scale = attention_scale(config)
    if config.attention_logit_softcapping is None:
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = do_softcapping(q @ k.mT * scale, config.attention_logit_softcapping) + mask  # [B, G, (H/G)*T, L]
        y = F.softmax(scores, dim=-1, dtype=torch.float).to(q.dtype) @ v
    # [B, G, (H/G)*T, D] -> [B, H, T, D] -> [B, T, H*D]
    return y.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    # x: [N, heads, D]; cos, sin: [N, 1, n_elem], one position per row (n_elem: config.rope_n_elem)
    n_elem = cos.shape[-1]
    rotate = apply_rope_interleave if interleave else apply_rope
    if n_elem == x.shape[-1]:  # full rotary: no pass-through part to concatenate
        return rotate(x, cos, sin)
    return torch.cat((rotate(x[..., :n_elem], cos, sin), x[..., n_elem:]), dim=-1)


def attention_forward(attn, cache, x, shared: StepShared, kind: int, lane_len: int, verify: bool = False):
    """litgpt CausalSelfAttention over a step's rows with its slot KV cache. x: [N, C] -> [N, C]. verify:
    the lanes are verify lanes (speculative decoding: few rows, each attending as a decode row does)."""
    cfg = attn.config
    N = x.shape[0]
    H, G, D = cfg.n_head, cfg.n_query_groups, cfg.head_size
    q, k, v = attn.qkv(x).split((H * D, G * D, G * D), dim=-1)  # [N, *]
    if cfg.norm_qk and cfg.norm_qk_type == "olmo2":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k, v = q.view(N, H, D), k.view(N, G, D), v.view(N, G, D)
    if cfg.norm_qk and cfg.norm_qk_type == "default":
        q, k = attn.norm_q(q), attn.norm_k(k)
    q, k = _rope(q, shared.cos, shared.sin, cfg.rope_interleave), _rope(k, shared.cos, shared.sin, cfg.rope_interleave)
    if N == cache.k.shape[0] and x.device.type == "cpu" and cfg.attention_logit_softcapping is None:
        mask = shared.decode_mask[kind]  # a decode-only step: one call (the project's executor: one op)
        return attn.proj(decode_rows_attention(q, k, v, cache.k, cache.v, shared.kv_rows, mask, attention_scale(cfg)))
    if verify and x.device.type == "cpu" and cfg.attention_logit_softcapping is None:
        row_slot, mask = verify_rows(shared, kind, lane_len)  # the project's executor: one op
        y = slot_rows_attention(q, k, v, cache.k, cache.v, shared.kv_rows, row_slot, mask, attention_scale(cfg))
        return attn.proj(y)
    cache_k, cache_v = cache(shared.kv_rows, k, v)  # [B, G, S + 1 + C, D]
    return attn.proj(slot_attention(q, cache_k, cache_v, shared, kind, lane_len, cfg))


def verify_rows(shared: StepShared, kind: int, lane_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's slot [N] and own mask [N, 1, 1, L] in a step of decode rows and verify lanes: a lane's
    token t is row t of head 0 in its folded mask."""
    B, L = shared.decode_mask.shape[1], shared.decode_mask.shape[-1]
    P = shared.lane_slot.shape[0]
    lanes = shared.lane_mask[kind][:, 0, :lane_len]  # [P, C, L]
    mask = torch.cat((shared.decode_mask[kind].reshape(B, L), lanes.reshape(P * lane_len, L))).view(-1, 1, 1, L)
    decode_slots = torch.arange(B, device=shared.lane_slot.device)
    row_slot = torch.cat((decode_slots, shared.lane_slot.view(P, 1).expand(P, lane_len).reshape(P * lane_len)))
    return row_slot, mask


def slot_rows_attention(q, k, v, cache_k, cache_v, rows, row_slot, mask, scale: float) -> torch.Tensor:
    """A verify step's attention, KV writes included: every row writes its k, v at the flat `rows`, then
    attends over its own slot's first L entries with its own mask row, as a decode row does (a verify
    lane's tokens are rows of one slot at consecutive positions). q: [N, H, D]; k, v: [N, G, D]; cache_k,
    cache_v: [B, G, S', D]; rows: [N * G]; row_slot: [N]; mask: [N, 1, 1, L] -> [N, H * D]. On CPU the
    project's executor runs it as one native op reading the caches in place; these ops copy each row's
    slot entries (the oracle's way)."""
    index_copy_flat(cache_k, 2, rows, k)
    index_copy_flat(cache_v, 2, rows, v)
    N, H, D = q.shape
    G, L = cache_k.shape[1], mask.shape[-1]
    keys = cache_k[:, :, :L].index_select(0, row_slot)  # [N, G, L, D]
    values = cache_v[:, :, :L].index_select(0, row_slot)
    y = F.scaled_dot_product_attention(q.reshape(N, G, H // G, D), keys, values, attn_mask=mask, scale=scale)
    return y.reshape(N, H * D)


def decode_rows_attention(q, k, v, cache_k, cache_v, rows, mask, scale: float) -> torch.Tensor:
    """A decode-only step's attention, KV writes included: row b writes its k, v into its slot's cache at
    the flat `rows`, then attends over the slot's first L entries. q: [B, H, D]; k, v: [B, G, D]; cache_k,
    cache_v: [B, G, S', D]; rows: [B * G]; mask: [B, 1, 1, L] -> [B, H * D]. On CPU the project's executor
    runs it as one native op (compile.attention): ~25 fewer host calls per layer than these ops traced."""
    index_copy_flat(cache_k, 2, rows, k)
    index_copy_flat(cache_v, 2, rows, v)
    B, H, D = q.shape
    G, L = cache_k.shape[1], mask.shape[-1]
    grouped = q.reshape(B, G, H // G, D)  # the H/G query heads of a group as its rows, as grouped_attention
    y = F.scaled_dot_product_attention(grouped, cache_k[:, :, :L], cache_v[:, :, :L], attn_mask=mask, scale=scale)
    return y.reshape(B, H * D)  # [B, G, H/G, D] is [B, H, D]


def slot_attention(q, cache_k, cache_v, shared: StepShared, kind: int, lane_len: int, config) -> torch.Tensor:
    """Each row against its own slot's first L cache entries. q: [N, H, D]; cache_k/v: [B, G, S', D]
    -> [N, H * D]. Rows 0..B-1 decode slot b; the rest are lanes of `lane_len` rows; `kind` picks the mask."""
    B, L = cache_k.shape[0], shared.decode_mask.shape[-1]
    N, H, D = q.shape
    keys, values = cache_k[:, :, :L], cache_v[:, :, :L]  # [B, G, L, D]: the live window only
    decode = grouped_attention(q[:B].unsqueeze(2), keys, values, shared.decode_mask[kind], config)  # [B, 1, H*D]
    if N == B:  # a decode-only step
        return decode.view(B, H * D)
    P = (N - B) // lane_len
    lane_q = q[B:].view(P, lane_len, H, D).transpose(1, 2)  # [P, H, C, D]
    lane_k, lane_v = keys.index_select(0, shared.lane_slot), values.index_select(0, shared.lane_slot)  # [P, G, L, D]
    lanes = grouped_attention(lane_q, lane_k, lane_v, shared.lane_mask[kind], config)  # [P, C, H*D]
    return torch.cat((decode.view(B, H * D), lanes.reshape(P * lane_len, H * D)))


def block_forward(
    block, cache, x, shared: StepShared, lane_len: int, mlp=None, verify: bool = False, one_call: bool = False
) -> torch.Tensor:
    """litgpt Block.forward (both residual layouts) with our attention. x: [N, C]; shared.cos/sin: the
    layer's own; mlp: what runs in place of block.mlp on [N, C] rows (an MoE layer's StackedExperts);
    one_call: a decode-only step runs the block as `decode_block` (set by the compile layer where the
    project's executor runs it as one native op)."""
    cfg = block.config
    kind = 1 if block.attn.apply_sliding_window_attention else 0
    if one_call and x.shape[0] == cache.k.shape[0]:  # a decode-only step
        return _decode_block_of(block, cache, x, shared, kind)
    x_normed = block.norm_1(x)
    attention = attention_forward(block.attn, cache, x_normed, shared, kind, lane_len, verify)
    attention_output = block.post_attention_norm(attention)
    if cfg.parallel_residual:
        if not cfg.shared_attention_norm:
            x_normed = block.norm_2(x)
        x = attention_output + x
    else:
        x = attention_output + x
        x_normed = block.norm_2(x)
    mlp = block.mlp if mlp is None else mlp
    return block.post_mlp_norm(mlp(x_normed)) + x


def _decode_block_of(block, cache, x, shared: StepShared, kind: int) -> torch.Tensor:
    """`decode_block` on this layer's weights and cache."""
    attn, mlp, norms = block.attn, block.mlp, (block.norm_1, block.norm_2)
    linears = (attn.proj.weight, mlp.fc_1.weight, mlp.fc_2.weight, mlp.proj.weight)
    weights = (norms[0].weight, norms[1].weight, attn.qkv.weight, attn.qkv.bias, *linears)
    caches = (cache.k, cache.v, shared.kv_rows, shared.decode_mask, kind)
    eps = (norms[0].eps, norms[1].eps)
    return decode_block(x, *weights, shared.cos, shared.sin, *caches, *eps, attention_scale(block.config))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """litgpt's RMSNorm over the last dim without unit offset, as its module computes it. x: [N, C]."""
    dtype = x.dtype
    x = x.float()
    x_normed = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return (x_normed * weight.float()).to(dtype=dtype)


def decode_block(
    x,
    norm_1,
    norm_2,
    qkv,
    qkv_bias,
    proj,
    fc_1,
    fc_2,
    mlp_proj,
    cos,
    sin,
    cache_k,
    cache_v,
    rows,
    masks,
    kind,
    eps_1,
    eps_2,
    scale,
) -> torch.Tensor:
    """A decode-only step's llama-shaped block (RMSNorm, RoPE'd grouped attention with its KV writes, SiLU-gated
    MLP, no biases but qkv's, residual adds in sequence) as litgpt's modules compute it; the project's executor
    runs it as one native op (compile.block_op): one host call a layer instead of eleven. x: [B, C]; norms [C];
    weights [out, in]; qkv_bias [out] or None; cos, sin: [B, 1, n_elem]; caches [B, G, S', D]; rows [B * G];
    masks [K, B, 1, 1, L] (`kind` picks this layer's) -> [B, C]. Under a torch function mode (the project's
    kernels in eager code, as the load check runs it) the mode may run it as the executor does."""
    tensors = (x, norm_1, norm_2, qkv, qkv_bias, proj, fc_1, fc_2, mlp_proj, cos, sin, cache_k, cache_v, rows, masks)
    if has_torch_function(tensors):
        return handle_torch_function(decode_block, tensors, *tensors, kind, eps_1, eps_2, scale)
    B, G, D = x.shape[0], cache_k.shape[1], cache_k.shape[3]
    H = qkv.shape[0] // D - 2 * G
    q, k, v = F.linear(rms_norm(x, norm_1, eps_1), qkv, qkv_bias).split((H * D, G * D, G * D), dim=-1)
    q, k = _rope(q.view(B, H, D), cos, sin, False), _rope(k.view(B, G, D), cos, sin, False)
    y = decode_rows_attention(q, k, v.view(B, G, D), cache_k, cache_v, rows, masks[kind], scale)  # [B, H * D]
    x = F.linear(y, proj) + x
    normed = rms_norm(x, norm_2, eps_2)
    return F.linear(F.silu(F.linear(normed, fc_1)) * F.linear(normed, fc_2), mlp_proj) + x
