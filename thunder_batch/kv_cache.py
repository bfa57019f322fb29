"""Slot KV cache: one buffer row per slot, written in place by position. The engine owns one per layer;
the caller's model (and its own `kv_cache` attributes) is never touched."""

from __future__ import annotations

import torch
from torch import nn

from thunder_batch.index_ops import index_copy_flat
from thunder_batch.step_plan import PrefixRestore, PrefixSave


class SlotKVCache(nn.Module):
    """K/V buffers `[B, G, S + 1 + C, D]` for B slots and G key/value heads.

    Entries `0 .. S-1` hold real tokens by position; the entries past `S` are a scratch area where
    padding rows write (a slot's idle decode row at `S`, pad t of a prefill lane at `S + 1 + t`), so
    padding never touches an entry a real token reads, no index leaves the buffer, and no step reads
    scratch (attention reads the first L <= S entries). A slot is reused without clearing: the
    position-derived mask hides whatever a previous request left behind.
    """

    def __init__(
        self,
        batch_size: int,
        n_kv_heads: int,
        length: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, n_kv_heads, length, head_size)
        # Created in the final dtype up front: rebinding a buffer inside a traced step is lost.
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def forward(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # rows: [N * G] from flat_rows (the same for every layer of a step); k, v: [N, G, D]
        # -> the whole buffers [B, G, S + 1 + C, D]
        index_copy_flat(self.k, 2, rows, k)
        index_copy_flat(self.v, 2, rows, v)
        return self.k, self.v


def slot_caches(gpt: nn.Module, batch_size: int, length: int) -> list[SlotKVCache]:
    """One SlotKVCache per layer of a litgpt GPT, in the model's dtype and device."""
    cfg, weight = gpt.config, gpt.transformer.wte.weight
    return [
        SlotKVCache(batch_size, cfg.n_query_groups, length, cfg.head_size, weight.dtype, weight.device)
        for _ in gpt.transformer.h
    ]


def copy_entries(caches: list[SlotKVCache], copies, stored: dict[int, list]) -> None:
    """Carry out a plan's copies in order: PrefixCopy between slots, PrefixSave of a slot's first entries
    into `stored` (host memory, per layer K and V [G, end, D]), PrefixRestore from there into a slot."""
    for c in copies:
        if isinstance(c, PrefixSave):
            stored[c.entry] = [
                (b.k[c.src, :, : c.end].to("cpu", copy=True), b.v[c.src, :, : c.end].to("cpu", copy=True))
                for b in caches
            ]
        elif isinstance(c, PrefixRestore):
            for cache, (k, v) in zip(caches, stored[c.entry]):
                cache.k[c.dst, :, c.start : c.end].copy_(k[:, c.start : c.end])
                cache.v[c.dst, :, c.start : c.end].copy_(v[:, c.start : c.end])
        else:
            for cache in caches:
                for buf in (cache.k, cache.v):  # [B, G, S + 1 + C, D]
                    buf[c.dst, :, c.start : c.end].copy_(buf[c.src, :, c.start : c.end])


def bytes_per_token(caches: list[SlotKVCache]) -> int:
    """Memory one token's entries take: every layer's K and V."""
    return sum(2 * cache.k[0, :, 0].numel() * cache.k.element_size() for cache in caches)
