"""The loop under a grammar (LOOP-GRAMMAR-1) and the spec's own matcher (MASK-MATCHER-1).

The grammar here is `ChoiceMatcher`: a few byte strings, each ended by EOS.
The engine's matchers (xgrammar) are tested against the same clauses in
tests/engine/test_structured_outputs.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.spec import sampling
from decodespec.spec.generate import generate
from decodespec.spec.params import SamplingParams
from decodespec.spec.sampling import InvalidLogitsError
from decodespec.spec.token_mask import ChoiceMatcher, allowed_token_mask, apply_token_bitmask
from tests.spec.test_generate import (
    EOS,
    MODELS,
    TOKENIZER,
    VOCAB,
    models,
    prompts,
    run,
    sampled_params,
)

choice_lists = st.lists(
    st.lists(st.integers(0, 255), min_size=1, max_size=4), min_size=1, max_size=3
)


def allowed(matcher: ChoiceMatcher) -> list[int]:
    row = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row)
    return allowed_token_mask(row[None], VOCAB)[0].nonzero().flatten().tolist()


@pytest.mark.clause("MASK-MATCHER-1")
def test_the_choice_matcher_allows_its_stop_token_exactly_when_complete():
    matcher = ChoiceMatcher([[1, 2], [1], [200, 40]], stop_token_ids=[EOS], vocab_size=VOCAB)
    assert allowed(matcher) == [1, 200]
    assert not matcher.accept_token(2)  # refused, and nothing changes
    assert allowed(matcher) == [1, 200]
    assert matcher.accept_token(1)
    assert allowed(matcher) == [2, EOS]  # "1" is complete; "1 2" goes on
    assert matcher.accept_token(2) and allowed(matcher) == [EOS]
    assert matcher.accept_token(EOS) and matcher.is_terminated()
    assert allowed(matcher) == []  # terminated: nothing more
    matcher.rollback(2)
    assert not matcher.is_terminated() and allowed(matcher) == [2, EOS]
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(5)


@pytest.mark.clause("MASK-MATCHER-1", "MASK-LAYOUT-1")
def test_the_choice_matcher_sets_the_sign_bit_for_token_31_of_a_word():
    matcher = ChoiceMatcher([[31], [63]], stop_token_ids=[EOS], vocab_size=VOCAB)
    assert allowed(matcher) == [31, 63]


@pytest.mark.clause("LOOP-GRAMMAR-1", "MASK-ADVANCE-1")
@settings(max_examples=15)
@given(models, prompts, sampled_params(ignore_eos=False, min_tokens=0), choice_lists)
def test_a_constrained_request_writes_one_of_the_choices(weights, prompt, params, choices):
    steps = run(weights, prompt, params, matcher=ChoiceMatcher(choices, [EOS], VOCAB))
    output = [s.token_id for s in steps]
    stops = set(params.stop_token_ids)
    if steps[-1].finish_reason == "length" or output[-1] in stops - {EOS}:
        # Cut short by max_tokens or a user stop id: a prefix of a choice (or a choice).
        assert any(c[: len(output)] == output for c in choices), (output, choices)
    else:
        assert output[-1] == EOS and output[:-1] in choices, (output, choices)


@pytest.mark.clause("LOOP-GRAMMAR-1", "MASK-SAMPLE-1")
@settings(max_examples=10)
@given(models, prompts, sampled_params(ignore_eos=False, min_tokens=0), choice_lists)
def test_the_loop_samples_the_masked_logits(weights, prompt, params, choices):
    """The same tokens as an unconstrained loop whose `sample` masks the logits by hand
    with a second matcher advanced by the tokens it returns."""
    shadow = ChoiceMatcher(choices, [EOS], VOCAB)

    def masked_sample(logits, **tensors):
        tensors = dict(tensors)
        assert torch.equal(tensors.pop("token_bitmask"), bitmask_of(shadow))
        token = sampling.sample(apply_token_bitmask(logits, bitmask_of(shadow)), **tensors)
        assert shadow.accept_token(int(token[0]))
        return token

    constrained = run(weights, prompt, params, matcher=ChoiceMatcher(choices, [EOS], VOCAB))
    # The loop's own matcher still runs: `masked_sample` checks the mask it passes.
    by_hand = run(
        weights, prompt, params, sample=masked_sample, matcher=ChoiceMatcher(choices, [EOS], VOCAB)
    )
    assert [s.token_id for s in by_hand] == [s.token_id for s in constrained]


def bitmask_of(matcher: ChoiceMatcher) -> torch.Tensor:
    row = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(row[0])
    return row


@pytest.mark.clause("LOOP-GRAMMAR-1", "LOOP-REQUEST-1")
def test_ignore_eos_with_a_grammar_is_refused_before_the_model_runs():
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    with pytest.raises(ValueError, match="ignore_eos"):
        run(MODELS[0], [1], params, matcher=ChoiceMatcher([[1]], [EOS], VOCAB))


@pytest.mark.clause("MASK-MINTOK-1", "LOOP-VALID-1", "LOOP-GRAMMAR-1")
def test_min_tokens_past_a_complete_grammar_is_an_invalid_step():
    """The choice is complete after 2 tokens, min_tokens 3 holds EOS back: the third step
    has nothing left and raises, after the two steps already streamed."""
    params = SamplingParams(temperature=0.8, seed=5, min_tokens=3, max_tokens=6)
    steps = []
    with pytest.raises(InvalidLogitsError):
        for step in run_lazily(MODELS[0], [3, 4], params, ChoiceMatcher([[7, 8]], [EOS], VOCAB)):
            steps.append(step.token_id)
    assert steps == [7, 8]


def run_lazily(weights, prompt, params, matcher):
    return generate(
        weights,
        prompt,
        params,
        eos_token_ids=TOKENIZER.eos_token_ids,
        token_bytes=TOKENIZER.token_bytes,
        matcher=matcher,
    )


@pytest.mark.clause("LOOP-GRAMMAR-1", "LOOP-LOGPROB-1", "MASK-ORDER-1")
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_name_the_alternatives_the_grammar_removed(mode):
    """Raw logprobs are the model's: its top alternatives include tokens the grammar
    removed, and `removed` names them; processed ones put those at -inf."""
    params = SamplingParams(temperature=0, max_tokens=3, top_logprobs=20, logprobs_mode=mode)
    choices = [[7, 8], [9]]
    steps = run(MODELS[0], [3, 4], params, matcher=ChoiceMatcher(choices, [EOS], VOCAB))
    first = steps[0].logprobs
    assert set(first.removed) == {t for t, _ in first.top} - {7, 9}
    if mode == "processed":
        assert all(lp == float("-inf") for t, lp in first.top if t in first.removed)
        assert first.removed  # 20 alternatives, 2 allowed
    else:
        assert len(first.removed) >= 18
    unconstrained = run(MODELS[0], [3, 4], params)
    assert unconstrained[0].logprobs.removed == ()
