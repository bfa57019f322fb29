"""The cancel board: uids of requests their clients abandoned (hung up, timed out), posted by the
HTTP processes and read by the inference workers between steps.

Shared memory, no helper process: a fixed table of entries (state, time posted, 16-byte uid). An
entry stays posted until the worker holding that uid claims it, so a cancel that arrives before its
request reaches any worker is applied when one takes it from the queue. Entries no worker claims
(the request had just finished) are claimed by the worker that finished it, or reused after TTL_S.
Posting takes a lock (HTTP processes only); workers never lock: they read a snapshot when the
board's version changed and flip one byte to claim an entry.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time

logger = logging.getLogger(__name__)
SIZE = 4096
TTL_S = 3600.0  # a posted entry older than this may be reused
FREE, POSTED, CLAIMED = 0, 1, 2
_UID = 16  # bytes of a uuid4().hex uid


class CancelBoard:
    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self._state = mp.RawArray("b", size)
        self._posted_at = mp.RawArray("d", size)
        self._uids = mp.RawArray("c", size * _UID)
        self._version = mp.RawValue("q", 0)  # bumped by every post
        self._cursor = mp.RawValue("q", 0)
        self._lock = mp.get_context(
            "spawn"
        ).Lock()  # pickled to the spawned workers, inherited by the forked HTTP processes
        self._seen: tuple[int, dict[str, int]] = (-1, {})  # this process's snapshot: version, uid -> entry

    def post(self, uid: str) -> None:
        """Cancel request `uid` (a 32-hex-digit uid) on every worker, now or whenever one takes it."""
        key = bytes.fromhex(uid)
        with self._lock:
            i = self._free_entry()
            self._state[i] = FREE  # a reader never sees a half-written uid as posted
            self._uids[i * _UID : (i + 1) * _UID] = key
            self._posted_at[i] = time.time()
            self._state[i] = POSTED
            self._version.value += 1

    def _free_entry(self) -> int:
        now, start = time.time(), self._cursor.value
        for k in range(self.size):
            i = (start + k) % self.size
            if self._state[i] != POSTED or now - self._posted_at[i] > TTL_S:
                self._cursor.value = i + 1
                return i
        oldest = min(range(self.size), key=self._posted_at.__getitem__)
        logger.warning("cancel board full (%d live entries): dropping the oldest cancel", self.size)
        return oldest

    def posted(self) -> dict[str, int]:
        """uid -> entry for every posted cancel (this process's snapshot, refreshed on change)."""
        version = self._version.value
        if version != self._seen[0]:
            # States before uids: a post writes its uid before it marks the entry POSTED, so an entry seen
            # POSTED here has its uid in place. (Uids first could pair a reused entry's old uid with the new
            # post's POSTED, and claiming that old uid would drop the new cancel.)
            states = bytes(self._state)
            raw = bytes(self._uids)
            live = {raw[i * _UID : (i + 1) * _UID].hex(): i for i, s in enumerate(states) if s == POSTED}
            self._seen = (version, live)
        return self._seen[1]

    def claim(self, uids) -> list[str]:
        """Those of `uids` that are posted: claimed (the entry is freed) and returned."""
        posted = self.posted()
        if not posted:
            return []
        if isinstance(uids, (dict, set, frozenset)) and len(uids) > len(posted):
            hits = [uid for uid in posted if uid in uids]
        else:
            hits = [uid for uid in uids if uid in posted]
        for uid in hits:
            self._state[posted.pop(uid)] = CLAIMED
        return hits

    def pending(self) -> int:
        """Cancels posted and not yet claimed (a request still queued, or one that had just finished)."""
        return sum(s == POSTED for s in bytes(self._state))
