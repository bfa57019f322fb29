"""Prompt prefixes kept in host memory past the slots that held them (pure Python: the runner holds the
entries' tensors, this index says which exist).

A slot keeps its last request's cache entries only until another prompt is admitted into it. With more
conversations than slots (32 chats on 8 slots), a conversation's next turn usually finds its slot taken
and computes its whole history again. So when a slot's kept entries are about to be written over, the
scheduler saves them here first (`PrefixSave`), and a later prompt that shares more of them than any
slot holds gets them back (`PrefixRestore`): as llama-server's prompt cache in RAM does.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict


class PrefixStore:
    """Token ids of the stored prefixes, at most `capacity` tokens in all, least recently used dropped
    first. A prefix another one extends is dropped (the longer one serves both); one an entry already
    covers is not stored again. `take_dropped()` hands the dropped entries to the runner, which frees them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # entry -> token ids; oldest use first
        self.tokens = 0  # held by every entry
        self._ids = itertools.count()
        self._dropped: list[int] = []

    def add(self, ids: list[int]) -> int | None:
        """Store `ids`; the new entry, or None when an entry covers them already or they exceed the store."""
        if not ids or len(ids) > self.capacity:
            return None
        for entry, held in list(self.entries.items()):
            shared = common_prefix(held, ids, len(ids))
            if shared == len(ids):
                self.entries.move_to_end(entry)
                return None
            if shared == len(held):
                self._drop(entry)
        while self.tokens + len(ids) > self.capacity:
            self._drop(next(iter(self.entries)))
        entry = next(self._ids)
        self.entries[entry] = list(ids)
        self.tokens += len(ids)
        return entry

    def longest(self, prompt: list[int], limit: int) -> tuple[int | None, int]:
        """(entry, length) of the longest prefix of `prompt` (at most `limit` tokens) an entry holds."""
        best: tuple[int | None, int] = (None, 0)
        for entry, held in self.entries.items():
            length = common_prefix(held, prompt, limit)
            if length > best[1]:
                best = (entry, length)
        return best

    def use(self, entry: int) -> None:
        self.entries.move_to_end(entry)

    def clear(self) -> None:
        for entry in list(self.entries):
            self._drop(entry)

    def take_dropped(self) -> tuple[int, ...]:
        dropped, self._dropped = tuple(self._dropped), []
        return dropped

    def _drop(self, entry: int) -> None:
        self.tokens -= len(self.entries.pop(entry))
        self._dropped.append(entry)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the longest common prefix of a and b, at most `limit` (compared 64 at a time)."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
