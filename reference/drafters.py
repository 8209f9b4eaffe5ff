"""Drafters for speculative decoding: cheap guesses at a request's next tokens.

A drafter proposes up to K tokens; the target model verifies them in one
pass (`spec.speculative.verify_drafts`). This module holds the drafter that
needs no second model: prompt lookup.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngram_draft(
    tokens: Sequence[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Prompt lookup: continue the sequence the way it continued before.

    The longest suffix of `tokens` (from `max_ngram` tokens down to
    `min_ngram`) that also occurs earlier in `tokens` is looked up; the draft
    is the up to `num_draft` tokens that followed its latest earlier
    occurrence. Deterministic: its draft distributions are one-hot. Works
    best on output that repeats its input (summaries, code edits, quotes).

    Args:
        tokens: the prompt and the output so far.
        num_draft: K >= 0, the most tokens to propose.
        max_ngram: longest suffix tried, >= min_ngram.
        min_ngram: shortest suffix tried, >= 1.

    Returns:
        Between 0 and `num_draft` token ids (none when no suffix recurs).

    Example:
        >>> ngram_draft([5, 6, 7, 8, 1, 5, 6], 3)
        [7, 8, 1]
    """
    if num_draft < 0:
        raise ValueError(f"num_draft must be >= 0, got {num_draft}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    tokens = list(tokens)
    if num_draft == 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # Latest earlier occurrence first: recent context predicts best. An occurrence
        # ends before the suffix itself, so at least one token follows it.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_draft]
    return []
