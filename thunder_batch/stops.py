"""Stop conditions: token-id stop sequences (a trie) and stop strings with streaming hold-back.

Pure Python, no torch: the engine feeds each sampled token id / text delta of a request here.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

__all__ = ["StopSequenceMatcher", "StopState", "StopStringHolder", "normalize_stop"]

_ACCEPTED = (
    "stop must be a non-empty string, a list of non-empty strings, a list of token ids "
    "(one sequence), a list of token-id lists, or a mix of strings and token-id lists "
    "(token ids are ints >= 0; an empty list means no stops)"
)


def _is_token_id(x: object) -> bool:
    # bool is an Integral too, but True as a token id is almost surely a caller's mistake.
    return isinstance(x, Integral) and not isinstance(x, bool) and x >= 0


def _token_seq(seq: object) -> tuple[int, ...]:
    if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) == 0:
        raise ValueError(f"{_ACCEPTED}; got token sequence {seq!r}")
    if not all(_is_token_id(t) for t in seq):
        raise ValueError(f"{_ACCEPTED}; got token sequence {seq!r}")
    return tuple(int(t) for t in seq)


def _stop_string(s: object) -> str:
    if not isinstance(s, str) or not s:
        raise ValueError(f"{_ACCEPTED}; got {s!r}")
    return s


def normalize_stop(stop: object) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """The user-facing ``stop`` parameter -> (stop_strings, stop_token_sequences), deduplicated.

    ``None`` and empty lists/tuples mean no stops (OpenAI clients send ``stop: null``).
    """
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        return (_stop_string(stop),), ()
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"{_ACCEPTED}; got {type(stop).__name__} {stop!r}")
    if stop and all(_is_token_id(t) for t in stop):
        return (), (_token_seq(stop),)
    strings: dict[str, None] = {}  # dicts keep insertion order: a stable, deduplicated result
    seqs: dict[tuple[int, ...], None] = {}
    for item in stop:
        if isinstance(item, str):
            strings[_stop_string(item)] = None
        elif isinstance(item, (list, tuple)):
            seqs[_token_seq(item)] = None
        else:
            raise ValueError(f"{_ACCEPTED}; got item {item!r} in {stop!r}")
    return tuple(strings), tuple(seqs)


class StopSequenceMatcher:
    """Multi-token stop sequences as a trie over token ids with Aho-Corasick failure links.

    A request's state is one trie node, so overlapping and nested stops are all caught:
    stop [1, 2] in tokens 1, 1, 2 (which a single match counter misses), or [2, 3] and
    [1, 2, 3] in 1, 2, 3 (reports 3, the longest). The matcher is immutable and shared.
    """

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = tuple(dict.fromkeys(_token_seq(s) for s in sequences))
        self._goto: list[dict[int, int]] = [{}]  # node -> {token id: child node}; node 0 = root
        self._depth = [0]
        terminal = [False]
        for seq in self.sequences:
            node = 0
            for tok in seq:
                nxt = self._goto[node].get(tok)
                if nxt is None:
                    nxt = len(self._goto)
                    self._goto[node][tok] = nxt
                    self._goto.append({})
                    self._depth.append(self._depth[node] + 1)
                    terminal.append(False)
                node = nxt
            terminal[node] = True
        self._build_links(terminal)

    def _build_links(self, terminal: list[bool]) -> None:
        # BFS: a node's failure link (its longest proper suffix that is a trie path) is shallower,
        # so it is ready before the node's children need it.
        self._fail = [0] * len(self._goto)
        self._out = [0] * len(self._goto)  # length of the longest stop ending at this node
        queue = [0]
        for node in queue:
            for tok, child in self._goto[node].items():
                self._fail[child] = self._step(self._fail[node], tok) if node else 0
                # A stop ending here is longer than any reached through the failure link.
                via_fail = self._out[self._fail[child]]
                self._out[child] = self._depth[child] if terminal[child] else via_fail
                queue.append(child)

    def _step(self, node: int, tok: int) -> int:
        while node and tok not in self._goto[node]:
            node = self._fail[node]
        return self._goto[node].get(tok, 0)

    def new_state(self) -> StopState:
        return StopState(self)


class StopState:
    """Per-request cursor into a StopSequenceMatcher's trie."""

    __slots__ = ("_matcher", "_node")

    def __init__(self, matcher: StopSequenceMatcher):
        self._matcher = matcher
        self._node = 0

    def feed(self, token_id: int) -> int:
        """0 if no stop ends at this token, else the length of the longest stop ending here."""
        m = self._matcher
        self._node = m._step(self._node, token_id)
        return m._out[self._node]

    @property
    def pending(self) -> int:
        """Length of the longest tail of the fed tokens that could still grow into a stop: the
        tokens a streaming caller must hold back."""
        return self._matcher._depth[self._node]


class StopStringHolder:
    """Streaming text with stop strings.

    ``push`` returns the text that is safe to emit now, holding back the longest suffix that
    could still start a stop string. Generation stops at the stop string that *ends* first
    (as a token-by-token generator would see it); among stops ending at the same character the
    longest wins. The result is therefore the same however the text is split into deltas.
    Only the text before the stop is returned; the stop and anything after it never are.
    Each stop is matched by Knuth-Morris-Pratt over the characters as they come: memory linear in
    the stops' length (no set of every prefix), amortized constant work per character and stop.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(dict.fromkeys(_stop_string(s) for s in stops))
        self._fail = [_failure(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop: its longest prefix the text ends with
        self._held = ""
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        """(text to emit now, stopped). After a stop every push returns ("", True)."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        base = len(self._held)
        for i, ch in enumerate(delta):
            done = [len(s) for k, s in enumerate(self.stops) if self._feed(k, ch) == len(s)]
            if done:  # the first stop to end; the longest of those ending here
                self._held, self.stopped = "", True
                return buf[: base + i + 1 - max(done)], True
        hold = max(self._matched, default=0)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def _feed(self, k: int, ch: str) -> int:
        stop, fail, matched = self.stops[k], self._fail[k], self._matched[k]
        while matched and stop[matched] != ch:
            matched = fail[matched - 1]
        matched += stop[matched] == ch
        self._matched[k] = matched
        return matched

    def flush(self) -> str:
        """At finish without a stop: release the held-back text (it never became a stop)."""
        out, self._held = self._held, ""
        self._matched = [0] * len(self.stops)
        return out


def _failure(stop: str) -> list[int]:
    """KMP's table: fail[i] = length of the longest proper prefix of stop[: i + 1] that is also its suffix."""
    fail, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        k += stop[i] == stop[k]
        fail[i] = k
    return fail
