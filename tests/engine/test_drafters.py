"""The prompt-lookup drafter (reference/drafters.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from decodespec.reference.drafters import ngram_draft


def test_the_longest_recurring_suffix_decides():
    # "2 3" recurs (followed by 9); "3" alone recurs later (followed by 4).
    assert ngram_draft([2, 3, 9, 3, 4, 2, 3], 2) == [9, 3]
    assert ngram_draft([2, 3, 9, 3, 4, 2, 3], 2, max_ngram=1) == [4, 2]


def test_the_latest_occurrence_wins():
    assert ngram_draft([1, 7, 1, 8, 1], 1) == [8]


def test_the_draft_stops_at_the_end_of_the_sequence():
    assert ngram_draft([4, 5, 4], 5) == [5, 4]


@pytest.mark.parametrize("tokens", [[], [1], [1, 2, 3], [1, 2, 3, 4]])
def test_nothing_recurs_nothing_is_drafted(tokens):
    assert ngram_draft(tokens, 4) == []


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_draft"):
        ngram_draft([1, 1], -1)
    with pytest.raises(ValueError, match="min_ngram"):
        ngram_draft([1, 1], 2, min_ngram=3, max_ngram=2)


@given(
    tokens=st.lists(st.integers(0, 4), max_size=40),
    num_draft=st.integers(0, 6),
    max_ngram=st.integers(1, 4),
)
def test_a_draft_is_what_followed_an_earlier_occurrence_of_the_suffix(tokens, num_draft, max_ngram):
    draft = ngram_draft(tokens, num_draft, max_ngram=max_ngram)
    assert len(draft) <= num_draft
    if not draft:
        return
    # Some suffix length n and earlier start reproduce the draft exactly.
    assert any(
        tokens[start : start + n] == tokens[-n:]
        and tokens[start + n : start + n + num_draft] == draft
        for n in range(1, min(max_ngram, len(tokens) - 1) + 1)
        for start in range(len(tokens) - n)
    )
