"""Stop token sequences (trie), stop strings with streaming hold-back, and the `stop` parameter."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thunder_batch.stops import StopSequenceMatcher, StopStringHolder, normalize_stop


def feed_all(matcher, tokens):
    state = matcher.new_state()
    return [state.feed(t) for t in tokens]


def brute_force(sequences, tokens):
    """Reference: at each position, the longest stop that is a suffix of the tokens so far."""
    out = []
    for i in range(1, len(tokens) + 1):
        ends = [len(s) for s in sequences if len(s) <= i and tokens[i - len(s) : i] == list(s)]
        out.append(max(ends, default=0))
    return out


# ---------------------------------------------------------------- token-id trie


def test_overlapping_stop_is_caught():
    # A "how many matched so far" counter resets on the second 1 and misses this.
    assert feed_all(StopSequenceMatcher([[1, 2]]), [1, 1, 2]) == [0, 0, 2]


def test_nested_stops_report_longest():
    m = StopSequenceMatcher([[2, 3], [1, 2, 3]])
    assert feed_all(m, [1, 2, 3]) == [0, 0, 3]
    assert feed_all(m, [5, 2, 3]) == [0, 0, 2]


def test_stop_that_is_prefix_of_another():
    m = StopSequenceMatcher([[1, 2], [1, 2, 3]])
    assert feed_all(m, [1, 2, 3]) == [0, 2, 3]
    assert feed_all(m, [7, 1, 2, 4]) == [0, 0, 2, 0]


def test_single_token_stop_and_repeats():
    m = StopSequenceMatcher([[5], [5, 5, 5]])
    assert feed_all(m, [5, 5, 5, 1, 5]) == [1, 1, 3, 0, 1]


def test_failure_link_into_another_branch():
    # After 1, 2, 3 fails on 9, the suffix 2, 3 continues as the start of [2, 3, 9].
    m = StopSequenceMatcher([[1, 2, 3, 4], [2, 3, 9]])
    assert feed_all(m, [1, 2, 3, 9]) == [0, 0, 0, 3]


def test_states_are_independent_and_matcher_is_shared():
    m = StopSequenceMatcher([[1, 2]])
    a, b = m.new_state(), m.new_state()
    assert a.feed(1) == 0
    assert b.feed(2) == 0
    assert a.feed(2) == 2
    assert b.feed(2) == 0


def test_no_sequences_never_stops_and_duplicates_are_merged():
    assert feed_all(StopSequenceMatcher([]), [1, 2, 3]) == [0, 0, 0]
    m = StopSequenceMatcher([[1, 2], (1, 2)])
    assert m.sequences == ((1, 2),)


@pytest.mark.parametrize("bad", [[[]], [[1, -1]], [[1, 2.0]], [[True]], [[None]], ["ab"], [[1, "2"]]])
def test_matcher_rejects_bad_sequences(bad):
    with pytest.raises(ValueError, match="token ids"):
        StopSequenceMatcher(bad)


@settings(max_examples=300, deadline=None)
@given(
    sequences=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=6),
    tokens=st.lists(st.integers(0, 3), max_size=40),
)
def test_matcher_matches_brute_force(sequences, tokens):
    # A 4-symbol alphabet makes overlaps, nesting and shared prefixes frequent.
    assert feed_all(StopSequenceMatcher(sequences), tokens) == brute_force(sequences, tokens)


# ---------------------------------------------------------------- stop strings


def stream(stops, deltas):
    """Push all deltas; return (emitted text, stopped, index of the delta whose push stopped it or None)."""
    holder = StopStringHolder(stops)
    out, stopped_at = [], None
    for i, d in enumerate(deltas):
        text, stopped = holder.push(d)
        out.append(text)
        if stopped and stopped_at is None:
            stopped_at = i
    if stopped_at is None:
        out.append(holder.flush())
    return "".join(out), stopped_at is not None, stopped_at


def reference(stops, text):
    """Cut at the stop that ends first (longest among those ending at the same place)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def test_holds_back_possible_stop_prefix_and_flush_releases_it():
    h = StopStringHolder(["</end>"])
    assert h.push("hello </e") == ("hello ", False)
    assert h.push("x") == ("</ex", False)  # no longer a stop prefix: released
    assert h.push(" done </") == (" done ", False)
    assert h.flush() == "</"
    assert h.flush() == ""


def test_text_before_stop_returned_nothing_after():
    h = StopStringHolder(["STOP"])
    assert h.push("abc ST") == ("abc ", False)
    assert h.push("OP and more") == ("", True)
    assert h.push("even more") == ("", True)
    assert h.flush() == ""


def test_stop_inside_one_delta():
    assert stream(["\n\n"], ["one\n\ntwo"]) == ("one", True, 0)


def test_stop_equal_to_suffix_of_earlier_partial():
    # "ab" is held as a partial "abX"; the stop "b" is its suffix and must fire at once.
    h = StopStringHolder(["abX", "b"])
    assert h.push("za") == ("z", False)
    assert h.push("b") == ("a", True)
    assert stream(["abX", "b"], ["za", "bX"]) == ("za", True, 1)


def test_overlapping_stops_first_to_end_wins():
    assert stream(["abcd", "bc"], ["abcd"]) == ("a", True, 0)  # "abcd" would have cut at 0
    assert stream(["abcd", "bc"], list("abcd")) == ("a", True, 2)  # at "c": no waiting for "d"
    # Same end: the longer one is removed entirely.
    assert stream(["bc", "abc"], ["xabc"]) == ("x", True, 0)  # "bc" would have left "xa"
    assert stream(["bc", "abc"], list("xabc")) == ("x", True, 3)
    assert stream(["aab"], ["aaab"]) == ("a", True, 0)


def test_no_stops_passes_text_through():
    h = StopStringHolder([])
    assert h.push("abc") == ("abc", False)
    assert h.flush() == ""


def test_holder_rejects_empty_stop():
    with pytest.raises(ValueError):
        StopStringHolder(["ok", ""])


@settings(max_examples=200, deadline=None)
@given(data=st.data(), stop=st.text("ab\u00e9\U0001f600", min_size=1, max_size=5))
def test_single_stop_split_at_every_point(data, stop):
    prefix = data.draw(st.text("abc", max_size=6))
    text = prefix + stop + data.draw(st.text("abc", max_size=4))
    expected = reference([stop], text)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            got = stream([stop], [text[:i], text[i:j], text[j:]])
            assert got[:2] == expected


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=4),
    text=st.text("abcd", max_size=16),
    cuts=st.lists(st.integers(0, 16), max_size=6),
)
def test_stream_equals_reference_for_any_split(stops, text, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert stream(stops, deltas)[:2] == reference(stops, text)


# ---------------------------------------------------------------- normalize_stop


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, ((), ())),
        ((), ((), ())),
        ([], ((), ())),
        ("###", (("###",), ())),
        (["a", "b", "a"], (("a", "b"), ())),
        ([1, 2, 3], ((), ((1, 2, 3),))),
        ([[1, 2], [3], (1, 2)], ((), ((1, 2), (3,)))),
        (["\n", [7, 8]], (("\n",), ((7, 8),))),
        ([0], ((), ((0,),))),
    ],
)
def test_normalize_stop_accepted(stop, expected):
    assert normalize_stop(stop) == expected


@pytest.mark.parametrize(
    "stop",
    [
        "",
        [""],
        ["a", None],
        [None],
        [1.0],
        [[1, 2.5]],
        1.5,
        3,
        {"a": 1},
        [{"a": 1}],
        True,
        [True, False],
        [[True]],
        [[]],
        [-1],
        [[1, -2]],
        ["a", 1],
        [1, [2]],
        b"stop",
    ],
)
def test_normalize_stop_rejected_with_accepted_forms(stop):
    with pytest.raises(ValueError, match="stop must be .*string.*token ids"):
        normalize_stop(stop)
