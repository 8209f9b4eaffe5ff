"""The logits stage's per-request state and the grammar's sweep (`logits_state.py`).

A pass walks a request's matcher along its drafts once: fill the row after the
output, then per draft accept it and fill the next row, one rollback at the
end. K drafts cost K accepts (issue 39: each row used to re-accept the drafts
before it, K(K+1)/2), and the matcher ends where it began.
"""

from __future__ import annotations

import pytest
import torch

from decodespec.reference.engine import Engine
from decodespec.reference.grammar import GrammarCompiler, StructuredOutput
from decodespec.reference.logits_state import LogitsState, row_outputs
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.params import SamplingParams
from decodespec.spec.token_mask import allowed_token_mask, bitmask_words
from tests.engine.test_engine_vs_spec import small_model
from tests.engine.test_structured_outputs import TOKENIZER, VOCAB, mask_after

WORDS = bitmask_words(VOCAB)
# "ab" repeated, then an optional z: drafts of the prompt's "abab zzzz" leave it.
GRAMMAR = StructuredOutput("regex", source="(ab)+z?", field="t")


class CountingMatcher:
    """A matcher that counts the calls made on it."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.accepts = self.fills = self.rollbacks = 0

    def accept_token(self, token_id):
        self.accepts += 1
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask):
        self.fills += 1
        self.matcher.fill_bitmask(bitmask)

    def rollback(self, num_tokens):
        self.rollbacks += 1
        self.matcher.rollback(num_tokens)

    def is_terminated(self):
        return self.matcher.is_terminated()


def counting_state() -> tuple[LogitsState, CountingMatcher]:
    matcher = CountingMatcher(GrammarCompiler(TOKENIZER, VOCAB).matcher(GRAMMAR))
    return LogitsState(SamplingParams(), [1, 2], matcher=matcher), matcher


@pytest.mark.clause("MASK-ADVANCE-1")
@pytest.mark.parametrize("k", [0, 1, 4])
def test_k_drafts_cost_k_accepts_and_one_rollback(k):
    state, counter = counting_state()
    drafts = list(b"abab")[:k]
    allowed, rows = state.grammar_rows(drafts, WORDS)
    assert allowed == k
    assert (counter.accepts, counter.fills, counter.rollbacks) == (k, k + 1, 1 if k else 0)
    for j in range(k + 1):  # each row is the mask after the drafts before it
        assert torch.equal(rows[j], mask_after(counter.matcher, drafts[:j])), j


@pytest.mark.clause("MASK-ADVANCE-1")
def test_the_sweep_stops_at_the_first_rejected_draft_and_leaves_the_matcher():
    state, counter = counting_state()
    allowed, rows = state.grammar_rows(list(b"abz" + b"ab"), WORDS)
    assert allowed == 3 and rows.shape == (4, WORDS)  # "z" ends the language: nothing more
    assert not allowed_token_mask(rows[3:], VOCAB)[0, list(b"ab")].any()
    allowed, rows = state.grammar_rows(list(b"aa"), WORDS)
    assert allowed == 1 and rows.shape == (2, WORDS)
    # Left where it began: the whole language is still ahead.
    assert torch.equal(state.grammar_rows([], WORDS)[1][0], mask_after(counter.matcher, []))


def test_without_a_grammar_every_draft_is_allowed_and_no_mask_is_made():
    state = LogitsState(SamplingParams(), [1])
    assert state.grammar_rows([5, 6, 7], WORDS) == (3, None)
    with state.walk() as walk:
        assert walk is None


def test_row_outputs_are_the_output_then_each_draft_prefix():
    assert row_outputs([1, 2], [3, 4]) == [[1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert row_outputs([], []) == [[]]


@pytest.mark.clause("MASK-ADVANCE-1")
@pytest.mark.parametrize("drafter", ["ngram", "layers:1"])
def test_an_engine_accepts_each_draft_once_per_pass(drafter, monkeypatch):
    """Over a whole constrained run, the matcher's accepts are the drafts its passes
    swept (each once) and, for a model drafter, once more while drafting, plus the
    emitted tokens: nothing re-accepted row by row."""
    counters = []
    matcher = GrammarCompiler.matcher

    def counting(self, output):
        counters.append(CountingMatcher(matcher(self, output)))
        return counters[-1]

    monkeypatch.setattr(GrammarCompiler, "matcher", counting)
    engine = Engine(small_model(3), TOKENIZER, speculate=drafter, num_draft=4)
    swept, sweep_accepts, allowed = [], [], []
    constrain = engine._constrain

    def spy(request, draft):
        cut = constrain(request, draft)
        swept.append(len(draft.tokens))
        allowed.append(len(cut.tokens))
        # The drafts allowed, and the call that found the first one rejected.
        sweep_accepts.append(len(cut.tokens) + (len(cut.tokens) < len(draft.tokens)))
        return cut

    engine._constrain = spy
    request_id = engine.add_request(
        list(b"abab zzzz abab zzzz ab"),
        SamplingParams(temperature=0, max_tokens=12),
        RequestOptions(structured_output=GRAMMAR),
    )
    while engine.has_unfinished():
        engine.step()
    out = engine.output(request_id)
    (counter,) = counters
    assert sum(swept) > 0, "no drafts: the count shows nothing"
    emitted = len(out.token_ids)  # each taken for good (`LogitsState.advance`)
    if drafter == "ngram":
        assert counter.accepts == sum(sweep_accepts) + emitted
        assert counter.rollbacks == sum(1 for n in allowed if n)  # one per sweep that took any
    else:  # a model drafter also walks the matcher once as it draws each draft
        assert counter.accepts <= 2 * sum(sweep_accepts) + emitted
        assert counter.rollbacks <= 2 * len(swept)
