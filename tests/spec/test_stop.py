"""Properties of the stop stage (spec/stop.py): finishing, UTF-8 text and streaming."""

from __future__ import annotations

import codecs
import itertools
from dataclasses import dataclass

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from decodespec.spec.params import SamplingParams
from decodespec.spec.stop import (
    IncrementalDetokenizer,
    StopChecker,
    StreamDelta,
    first_stop_match,
    stop_hold_back,
)

# A small byte vocabulary: ASCII pieces, and the 2-, 3- and 4-byte UTF-8
# encodings of "é", "€" and "😀" whole and split in every way, plus an invalid
# byte and pieces that mix ASCII with half a character.
VOCAB: list[bytes] = [
    b"<eos>",
    b"<stop>",
    b"a",
    b"b",
    b"c",
    b" ",
    b"\n",
    b"ab",
    b"ba",
    b"abcd",
    b"\xc3",  # é = c3 a9
    b"\xa9",
    b"\xc3\xa9",
    b"\xe2",  # € = e2 82 ac
    b"\x82",
    b"\xac",
    b"\xe2\x82",
    b"\x82\xac",
    b"\xe2\x82\xac",
    b"\xf0",  # 😀 = f0 9f 98 80
    b"\x9f",
    b"\x98",
    b"\x80",
    b"\xf0\x9f",
    b"\x98\x80",
    b"\xf0\x9f\x98",
    b"\x9f\x98\x80",
    b"\xf0\x9f\x98\x80",
    b"a\xc3",
    b"\xa9b",
    b"\xff",  # never valid UTF-8
]
ID = {piece: i for i, piece in enumerate(VOCAB)}
EOS = ID[b"<eos>"]
STOP_ID = ID[b"<stop>"]
ALPHABET = "ab c\né€😀"


def token_bytes(token_id: int) -> bytes:
    return VOCAB[token_id]


def ids(*pieces: bytes) -> list[int]:
    return [ID[p] for p in pieces]


def checker_for(
    params: SamplingParams | None = None,
    *,
    prompt_len: int = 1,
    max_context: int = 1000,
    eos: tuple[int, ...] = (EOS,),
) -> StopChecker:
    return StopChecker(
        params if params is not None else SamplingParams(max_tokens=None),
        eos_token_ids=eos,
        token_bytes=token_bytes,
        prompt_len=prompt_len,
        max_context=max_context,
    )


def run(checker: StopChecker, tokens: list[int]) -> list[StreamDelta]:
    """Append tokens one at a time until the request finishes."""
    deltas = []
    for t in tokens:
        deltas.append(checker.append(t))
        if deltas[-1].finish_reason is not None:
            break
    return deltas


def joined(deltas: list[StreamDelta]) -> str:
    return "".join(d.text for d in deltas)


# ---------------------------------------------------------------------------
# An independent oracle: re-decodes everything from scratch after every token.


def earliest_match(text: str, stop: tuple[str, ...]) -> int | None:
    starts = [i for s in stop for i in range(len(text)) if text.startswith(s, i)]
    return min(starts, default=None)


def longest_held_suffix(text: str, stop: tuple[str, ...]) -> int:
    """Brute force: longest suffix of text that is a proper prefix of a stop string."""
    lengths = [
        k for k in range(1, len(text) + 1) for s in stop if len(s) > k and s[:k] == text[-k:]
    ]
    return max(lengths, default=0)


def oracle(
    params: SamplingParams,
    tokens: list[int],
    *,
    prompt_len: int,
    max_context: int,
    vocab: list[bytes] = VOCAB,
) -> tuple[list[int], str, str | None]:
    """(token ids, text, finish reason) straight from the SEMANTICS.md rules."""
    stop_ids = params.stop_ids([EOS])

    def cut(text: str, reason: str) -> tuple[str, str]:
        match = earliest_match(text, params.stop)
        return (text, reason) if match is None else (text[:match], "stop")

    for n in range(1, len(tokens) + 1):
        out = tokens[:n]
        data = b"".join(vocab[t] for t in out)
        if out[-1] in stop_ids and n - 1 >= params.min_tokens:
            before = b"".join(vocab[t] for t in out[:-1])
            return (out, *cut(before.decode("utf-8", "replace"), "stop"))
        complete, _ = codecs.utf_8_decode(data, "replace", False)
        match = earliest_match(complete, params.stop)
        if match is not None:
            return out, complete[:match], "stop"
        if (params.max_tokens is not None and n >= params.max_tokens) or (
            prompt_len + n >= max_context
        ):
            return (out, *cut(data.decode("utf-8", "replace"), "length"))
    data = b"".join(vocab[t] for t in tokens)
    return list(tokens), codecs.utf_8_decode(data, "replace", False)[0], None


@dataclass
class Request:
    params: SamplingParams
    tokens: list[int]
    prompt_len: int
    max_context: int

    def checker(self) -> StopChecker:
        return checker_for(self.params, prompt_len=self.prompt_len, max_context=self.max_context)


@st.composite
def stop_strings(draw: st.DrawFn, text: str, max_count: int = 3) -> tuple[str, ...]:
    """Stop strings, mostly substrings of `text` (so they do match), some arbitrary."""

    def one() -> str:
        if text and draw(st.booleans()):
            i = draw(st.integers(0, len(text) - 1))
            j = draw(st.integers(i + 1, min(len(text), i + 4)))
            return text[i:j]
        return draw(st.text(alphabet=ALPHABET + "\ufffd", min_size=1, max_size=3))

    return tuple(one() for _ in range(draw(st.integers(0, max_count))))


token_lists = st.lists(st.integers(0, len(VOCAB) - 1), max_size=16)


@st.composite
def requests(draw: st.DrawFn) -> Request:
    tokens = draw(token_lists)
    text = b"".join(VOCAB[t] for t in tokens).decode("utf-8", "replace")
    max_tokens = draw(st.none() | st.integers(1, 18))
    prompt_len = draw(st.integers(0, 8))
    return Request(
        SamplingParams(
            stop=draw(stop_strings(text)),
            stop_token_ids=tuple(draw(st.sets(st.integers(1, len(VOCAB) - 1), max_size=2))),
            ignore_eos=draw(st.booleans()),
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens if max_tokens is not None else 6)),
        ),
        tokens,
        prompt_len,
        max_context=draw(st.integers(prompt_len + 1, prompt_len + 20)),
    )


# ---------------------------------------------------------------------------
# The whole stage against the oracle


@pytest.mark.clause(
    "STOP-ID-1",
    "STOP-ID-2",
    "STOP-STR-1",
    "STOP-LEN-1",
    "STOP-PREC-1",
    "STOP-UTF8-1",
    "STOP-STREAM-1",
)
@given(requests())
def test_checker_matches_oracle(request_: Request) -> None:
    checker = request_.checker()
    deltas = run(checker, request_.tokens)
    expected = oracle(
        request_.params,
        request_.tokens,
        prompt_len=request_.prompt_len,
        max_context=request_.max_context,
    )
    assert (checker.token_ids, checker.text, checker.finish_reason) == expected
    # Only the last delta may carry a finish reason, and the stream adds up.
    assert all(d.finish_reason is None for d in deltas[:-1])
    if checker.finish_reason is not None:
        assert deltas[-1].finish_reason == checker.finish_reason
        assert joined(deltas) == checker.text
    assert earliest_match(checker.text, request_.params.stop) is None


# ---------------------------------------------------------------------------
# Stop ids


@pytest.mark.clause("STOP-ID-1")
@pytest.mark.parametrize("stop_token", [EOS, STOP_ID])
def test_stop_id_finishes_keeps_id_and_drops_its_text(stop_token: int) -> None:
    checker = checker_for(SamplingParams(max_tokens=None, stop_token_ids=[STOP_ID]))
    deltas = run(checker, [*ids(b"a", b"b"), stop_token, ID[b"c"]])
    assert checker.finish_reason == "stop"
    assert checker.token_ids == [*ids(b"a", b"b"), stop_token]
    assert checker.text == joined(deltas) == "ab"
    assert deltas[-1] == StreamDelta("", "stop")


@pytest.mark.clause("STOP-ID-1")
def test_ignore_eos_makes_eos_an_ordinary_token() -> None:
    params = SamplingParams(max_tokens=None, ignore_eos=True, stop_token_ids=[STOP_ID])
    checker = checker_for(params)
    deltas = run(checker, [ID[b"a"], EOS, ID[b"b"]])
    assert checker.finish_reason is None
    assert checker.text == joined(deltas) == "a<eos>b"
    # The user's stop ids still stop.
    assert checker.append(STOP_ID) == StreamDelta("", "stop")
    assert checker.token_ids == [ID[b"a"], EOS, ID[b"b"], STOP_ID]
    assert checker.text == "a<eos>b"


@pytest.mark.clause("STOP-ID-2")
@given(
    min_tokens=st.integers(0, 5),
    position=st.integers(0, 7),
    stop_token=st.sampled_from([EOS, STOP_ID]),
)
def test_stop_id_before_min_tokens_is_an_ordinary_token(
    min_tokens: int, position: int, stop_token: int
) -> None:
    params = SamplingParams(max_tokens=None, min_tokens=min_tokens, stop_token_ids=[STOP_ID])
    checker = checker_for(params)
    run(checker, [ID[b"a"]] * position)
    delta = checker.append(stop_token)
    text = "a" * position
    if position >= min_tokens:  # it had already produced min_tokens tokens
        assert delta.finish_reason == "stop"
        assert checker.text == text
    else:
        assert delta.finish_reason is None
        assert checker.text == text + VOCAB[stop_token].decode()
    assert checker.token_ids == [ID[b"a"]] * position + [stop_token]


# ---------------------------------------------------------------------------
# Stop strings


@pytest.mark.clause("STOP-STR-1")
def test_stop_string_cuts_text_but_not_ids() -> None:
    checker = checker_for(SamplingParams(max_tokens=None, stop=["bc"]))
    deltas = run(checker, ids(b"a", b" ", b"b", b"c", b"a"))
    assert checker.finish_reason == "stop"
    assert checker.token_ids == ids(b"a", b" ", b"b", b"c")
    assert checker.text == joined(deltas) == "a "
    # The text of the finishing token before and after the match is cut too.
    checker = checker_for(SamplingParams(max_tokens=None, stop=["b"]))
    run(checker, ids(b"c", b"abcd"))
    assert (checker.token_ids, checker.text) == (ids(b"c", b"abcd"), "ca")


@pytest.mark.clause("STOP-STR-1")
@pytest.mark.parametrize("stop", [("bc", "abcd"), ("abcd", "bc"), ("cd", "bc", "abc")])
def test_cut_at_earliest_starting_match(stop: tuple[str, ...]) -> None:
    # "bc" ends before "abcd" does, but "abcd" starts first: the cut is at its start.
    checker = checker_for(SamplingParams(max_tokens=None, stop=stop))
    deltas = run(checker, ids(b"c", b"abcd"))
    assert (checker.text, checker.finish_reason) == ("c", "stop")
    assert joined(deltas) == "c"


@pytest.mark.clause("STOP-STR-1")
def test_stop_strings_are_checked_before_min_tokens() -> None:
    checker = checker_for(SamplingParams(max_tokens=10, min_tokens=5, stop=["b"]))
    deltas = run(checker, ids(b"a", b"b", b"c"))
    assert checker.finish_reason == "stop"
    assert checker.token_ids == ids(b"a", b"b")
    assert checker.text == joined(deltas) == "a"


@pytest.mark.clause("STOP-STR-1")
@given(st.data())
def test_first_stop_match_is_the_earliest_start(data: st.DataObject) -> None:
    text = data.draw(st.text(alphabet="abc", max_size=12))
    stop = data.draw(stop_strings(text))
    start = data.draw(st.integers(0, len(text) + 1))
    expected = [i for s in stop for i in range(start, len(text)) if text.startswith(s, i)]
    assert first_stop_match(text, stop, start) == min(expected, default=None)


@pytest.mark.clause("STOP-STR-1")
@given(st.data())
def test_searching_from_the_window_finds_every_new_match(data: st.DataObject) -> None:
    # If text[:old_len] holds no match, every match starts at or after the window.
    text = data.draw(st.text(alphabet="abc", max_size=12))
    stop = data.draw(stop_strings(text))
    old_len = data.draw(st.integers(0, len(text)))
    assume(stop and earliest_match(text[:old_len], stop) is None)
    window = max(0, old_len - max(map(len, stop)) + 1)
    assert first_stop_match(text, stop, window) == first_stop_match(text, stop)


@pytest.mark.clause("STOP-STR-1")
def test_invalid_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        first_stop_match("abc", ["b", ""])
    with pytest.raises(ValueError, match="non-empty"):
        stop_hold_back("abc", [""])
    with pytest.raises(ValueError, match="start"):
        first_stop_match("abc", ["b"], -1)
    with pytest.raises(ValueError, match="prompt_len"):
        checker_for(prompt_len=8, max_context=8)


# ---------------------------------------------------------------------------
# Length and precedence


@pytest.mark.clause("STOP-LEN-1")
@pytest.mark.parametrize(
    ("max_tokens", "prompt_len", "max_context", "produced"),
    [(3, 1, 100, 3), (1, 1, 100, 1), (10, 5, 8, 3), (2, 5, 8, 2), (None, 5, 8, 3)],
)
def test_length_limit(
    max_tokens: int | None, prompt_len: int, max_context: int, produced: int
) -> None:
    checker = checker_for(
        SamplingParams(max_tokens=max_tokens), prompt_len=prompt_len, max_context=max_context
    )
    deltas = run(checker, ids(b"a", b"b", b"c", b"a", b"b", b"c"))
    assert len(deltas) == produced
    assert checker.finish_reason == deltas[-1].finish_reason == "length"
    assert checker.text == joined(deltas) == "abcabc"[:produced]


@pytest.mark.clause("STOP-LEN-1")
@given(prompt_len=st.integers(0, 10), room=st.integers(1, 12))
def test_max_tokens_none_runs_until_the_context_is_full(prompt_len: int, room: int) -> None:
    checker = checker_for(
        SamplingParams(max_tokens=None), prompt_len=prompt_len, max_context=prompt_len + room
    )
    for _ in range(room - 1):
        assert checker.append(ID[b"a"]).finish_reason is None
    assert checker.append(ID[b"a"]) == StreamDelta("a", "length")
    assert prompt_len + len(checker.token_ids) == prompt_len + room


@pytest.mark.clause("STOP-PREC-1")
@pytest.mark.parametrize("limit", ["max_tokens", "context"])
def test_stop_takes_precedence_over_length(limit: str) -> None:
    def at_limit(**stop: object) -> StopChecker:
        if limit == "max_tokens":
            return checker_for(SamplingParams(max_tokens=3, **stop))
        return checker_for(SamplingParams(max_tokens=None, **stop), prompt_len=4, max_context=7)

    # A stop id as the last allowed token.
    checker = at_limit(stop_token_ids=[STOP_ID])
    deltas = run(checker, [*ids(b"a", b"b"), STOP_ID])
    assert (checker.finish_reason, checker.text, joined(deltas)) == ("stop", "ab", "ab")
    # A stop string completed by the last allowed token.
    checker = at_limit(stop=["bc"])
    deltas = run(checker, ids(b"a", b"b", b"c"))
    assert (checker.finish_reason, checker.text, joined(deltas)) == ("stop", "a", "a")


@pytest.mark.clause("STOP-PREC-1", "STOP-UTF8-1")
def test_the_flushed_tail_is_checked_for_stop_strings() -> None:
    # At the length limit the incomplete "€" becomes U+FFFD, which completes "a\ufffd".
    checker = checker_for(SamplingParams(max_tokens=2, stop=["a\ufffd"]))
    deltas = run(checker, ids(b"a", b"\xe2\x82"))
    assert (checker.finish_reason, checker.text, joined(deltas)) == ("stop", "", "")


# ---------------------------------------------------------------------------
# Several tokens in one step


@pytest.mark.clause("STOP-MULTI-1")
def test_extend_is_cut_at_the_first_finishing_token() -> None:
    checker = checker_for(SamplingParams(max_tokens=None))
    assert checker.extend(ids(b"a", b"b")) == (2, StreamDelta("ab", None))
    assert checker.extend([ID[b"c"], EOS, ID[b"a"], EOS]) == (2, StreamDelta("c", "stop"))
    assert checker.token_ids == [*ids(b"a", b"b", b"c"), EOS]

    checker = checker_for(SamplingParams(max_tokens=None, stop=["b"]))
    assert checker.extend(ids(b"a", b"b", b"c")) == (2, StreamDelta("a", "stop"))
    assert checker.token_ids == ids(b"a", b"b")

    checker = checker_for(SamplingParams(max_tokens=2))
    assert checker.extend(ids(b"a", b"b", b"c")) == (2, StreamDelta("ab", "length"))
    assert checker.token_ids == ids(b"a", b"b")


@pytest.mark.clause("STOP-MULTI-1")
@given(requests(), st.lists(st.integers(0, 4), max_size=16))
def test_extend_equals_appending_one_by_one(request_: Request, sizes: list[int]) -> None:
    one_by_one = request_.checker()
    single = run(one_by_one, request_.tokens)
    stepped = request_.checker()
    deltas, rest, total_used = [], list(request_.tokens), 0
    for size in [*sizes, len(rest)]:
        used, delta = stepped.extend(rest[:size])
        assert used == min(size, len(rest)) or delta.finish_reason is not None
        deltas.append(delta)
        rest = rest[used:]
        total_used += used
        if delta.finish_reason is not None:
            break
    assert total_used == len(stepped.token_ids)
    assert stepped.token_ids == one_by_one.token_ids
    assert stepped.text == one_by_one.text
    assert stepped.finish_reason == one_by_one.finish_reason == deltas[-1].finish_reason
    assert joined(deltas) == joined(single)


@pytest.mark.clause("STOP-MULTI-1")
def test_appending_after_finish_raises() -> None:
    checker = checker_for(SamplingParams(max_tokens=1))
    assert checker.extend([]) == (0, StreamDelta("", None))
    checker.append(ID[b"a"])
    with pytest.raises(ValueError, match="already finished"):
        checker.append(ID[b"a"])
    with pytest.raises(ValueError, match="already finished"):
        checker.extend([ID[b"a"]])
    assert checker.token_ids == [ID[b"a"]]


# ---------------------------------------------------------------------------
# UTF-8


@pytest.mark.clause("STOP-UTF8-1")
def test_split_characters_are_held_until_complete() -> None:
    checker = checker_for()
    pieces = [b"\xe2", b"\x82", b"\xac", b"\xf0\x9f\x98", b"\x80", b"a\xc3", b"\xa9b"]
    texts = [checker.append(ID[p]).text for p in pieces]
    assert texts == ["", "", "€", "", "😀", "a", "éb"]


@pytest.mark.clause("STOP-UTF8-1")
def test_invalid_and_incomplete_bytes_become_replacement_characters() -> None:
    checker = checker_for()
    assert checker.append(ID[b"\xff"]).text == "\ufffd"
    assert checker.append(ID[b"\xa9"]).text == "\ufffd"  # a continuation byte alone
    assert checker.append(ID[b"\xe2\x82"]).text == ""
    assert checker.append(ID[b"a"]).text == "\ufffda"  # interrupted sequence
    # An incomplete tail is flushed when the request finishes, on a stop id ...
    assert checker.append(ID[b"\xf0\x9f"]).text == ""
    assert checker.append(EOS) == StreamDelta("\ufffd", "stop")
    assert checker.text == "\ufffd\ufffd\ufffda\ufffd"
    # ... and at the length limit.
    checker = checker_for(SamplingParams(max_tokens=2))
    deltas = run(checker, ids(b"a", b"\xc3"))
    assert deltas == [StreamDelta("a"), StreamDelta("\ufffd", "length")]


@st.composite
def split_text(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    """A valid text and its UTF-8 bytes cut at random points (also inside characters)."""
    text = draw(st.text(alphabet=ALPHABET, max_size=10))
    data = text.encode()
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(data) - 1)), max_size=len(data))))
    bounds = [0, *(c for c in cuts if c < len(data)), len(data)]
    chunks = [data[i:j] for i, j in itertools.pairwise(bounds) if j > i]
    return text, chunks


@pytest.mark.clause("STOP-UTF8-1")
@given(split_text())
def test_incremental_detokenizer_never_splits_a_character(case: tuple[str, list[bytes]]) -> None:
    text, chunks = case
    detokenizer = IncrementalDetokenizer(chunks.__getitem__)
    out = ""
    for i in range(len(chunks)):
        piece = detokenizer.push(i)
        assert "\ufffd" not in piece
        out += piece
        consumed = sum(map(len, chunks[: i + 1]))
        # Exactly the complete characters of the bytes so far.
        assert out == codecs.utf_8_decode(b"".join(chunks[: i + 1]), "strict", False)[0]
        assert len(out.encode()) <= consumed
    assert out + detokenizer.flush() == text


@pytest.mark.clause("STOP-UTF8-1", "STOP-STREAM-1")
@given(split_text(), st.data())
def test_valid_bytes_stream_without_replacement_characters(
    case: tuple[str, list[bytes]], data: st.DataObject
) -> None:
    text, chunks = case
    stop = data.draw(stop_strings(text))
    vocab = [b"<eos>", *chunks]
    params = SamplingParams(max_tokens=None, stop=stop)
    checker = StopChecker(
        params,
        eos_token_ids=[0],
        token_bytes=vocab.__getitem__,
        prompt_len=1,
        max_context=100,
    )
    deltas = run(checker, [*range(1, len(vocab)), 0])
    assert all("\ufffd" not in d.text for d in deltas)
    tokens = [*range(1, len(vocab)), 0]
    expected = oracle(params, tokens, prompt_len=1, max_context=100, vocab=vocab)
    assert (checker.token_ids, checker.text, checker.finish_reason) == expected
    assert joined(deltas) == checker.text
    assert text.startswith(checker.text)


# ---------------------------------------------------------------------------
# Streaming


@pytest.mark.clause("STOP-STREAM-1")
@given(requests())
def test_stream_holds_back_exactly_the_possible_stop_prefix(request_: Request) -> None:
    checker = request_.checker()
    stop = request_.params.stop
    emitted = ""
    for token in request_.tokens:
        delta = checker.append(token)
        emitted += delta.text
        assert checker.text.startswith(emitted)
        assert earliest_match(emitted, stop) is None  # never a full stop string
        if delta.finish_reason is not None:
            assert emitted == checker.text
            break
        # The held text is the longest suffix of the whole text that could still
        # become a stop string: nothing less (safety), nothing more (minimal delay).
        held = len(checker.text) - len(emitted)
        assert held == longest_held_suffix(checker.text, stop)
        assert held == stop_hold_back(checker.text, stop)


@pytest.mark.clause("STOP-STREAM-1")
@given(token_lists, token_lists.filter(bool), st.data())
def test_emitted_text_survives_every_continuation(
    prefix: list[int], continuation: list[int], data: st.DataObject
) -> None:
    # Stop strings are drawn from the whole text, so they often straddle the
    # boundary between what was streamed and what comes next.
    tokens = prefix + continuation
    whole = b"".join(VOCAB[t] for t in tokens).decode("utf-8", "replace")
    params = SamplingParams(max_tokens=None, stop=data.draw(stop_strings(whole)))
    # The context ends with the continuation, so the request finishes by then.
    checker = checker_for(params, prompt_len=1, max_context=1 + len(tokens))
    streamed = joined(run(checker, prefix))
    assume(checker.finish_reason is None)
    run(checker, continuation)
    assert checker.finish_reason is not None
    assert checker.text.startswith(streamed)


@pytest.mark.clause("STOP-STREAM-1")
def test_stream_example() -> None:
    checker = checker_for(SamplingParams(max_tokens=None, stop=["abc", "b\n"]))
    texts = [checker.append(t).text for t in ids(b"ba", b"b", b"a", b"c", b"b", b" ")]
    # "ba": "a" may start "abc"; "b": "ab" may start "abc", "b" may start "b\n";
    # "a": "aba" cannot, but "a" may start "abc"; "c": "ac" cannot.
    assert texts == ["b", "", "ab", "ac", "", "b "]
    assert checker.append(ID[b"abcd"]) == StreamDelta("", "stop")
    assert checker.text == "babacb "


@pytest.mark.clause("STOP-STREAM-1")
@given(token_lists)
def test_without_stop_strings_nothing_is_held(tokens: list[int]) -> None:
    checker = checker_for(SamplingParams(max_tokens=None, ignore_eos=True))
    detokenizer = IncrementalDetokenizer(token_bytes)
    for t in tokens:
        assert checker.append(t).text == detokenizer.push(t)


@pytest.mark.clause("STOP-STREAM-1")
@given(st.text(alphabet="abc", max_size=8), st.data())
def test_stop_hold_back_is_the_longest_proper_prefix_suffix(text: str, data: st.DataObject) -> None:
    stop = data.draw(stop_strings(text + "abc"))
    assert stop_hold_back(text, stop) == longest_held_suffix(text, stop)
