"""The sampler's greedy shortcut: a pass of plain greedy rows skips the sampling tensors.

`Sampler.choose` answers a pass whose every request is plain greedy
(`sampler.plain_greedy`) with each row's first argmax. These tests hold it to
the spec's `sample` row by row (SAMPLE-GREEDY-1, SAMPLE-VALID-1), ties, NaN and
infinities included, and check that a request with anything more (a bias, an
unmet min_tokens, a penalty, logprobs) still goes the whole way.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.reference.backend import SPEC_BACKEND
from decodespec.reference.logits_state import LogitsState
from decodespec.reference.request import Draft
from decodespec.reference.sampler import MODEL_INVALID, Sampler, plain_greedy
from decodespec.spec.params import SamplingParams
from decodespec.spec.sampling import InvalidLogitsError, sample

VOCAB = 7
EOS = (VOCAB - 1,)
# Few distinct values, so that rows tie often; and the values SAMPLE-VALID-1 is about.
VALUES = st.sampled_from([0.0, 1.0, 2.5, -3.0, math.inf, -math.inf, math.nan])
ROWS = st.lists(st.lists(VALUES, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=5)


def spec_token(row: list[float], params: SamplingParams, output: list[int]) -> int | None:
    """The spec's token for one row alone (None: the row is invalid)."""
    sampler = Sampler(SPEC_BACKEND, VOCAB, EOS)
    tensors = sampler.tensors([LogitsState(params, [0])], [output], torch.device("cpu"))
    try:
        return int(sample(torch.tensor([row]), **tensors)[0])
    except InvalidLogitsError:
        return None


def choose(rows: list[list[float]], params: list[SamplingParams], outputs: list[list[int]]):
    sampler = Sampler(SPEC_BACKEND, VOCAB, EOS)
    states = [LogitsState(p, [0]) for p in params]
    return sampler.choose(torch.tensor(rows), states, outputs, [Draft([]) for _ in rows])


@pytest.mark.clause("SAMPLE-GREEDY-1", "SAMPLE-VALID-1")
@settings(max_examples=200, deadline=None)
@given(rows=ROWS)
def test_plain_greedy_passes_choose_the_specs_token_or_fail_as_it_does(rows):
    params = [SamplingParams(temperature=0.0) for _ in rows]
    outputs = [[] for _ in rows]
    assert all(map(plain_greedy, [LogitsState(p, [0]) for p in params], outputs,
                   [Draft([]) for _ in rows]))  # fmt: skip
    for row, outcome in zip(rows, choose(rows, params, outputs), strict=True):
        want = spec_token(row, params[0], [])
        if want is None:
            assert (outcome.tokens, outcome.error) == ([], MODEL_INVALID), row
        else:
            assert (outcome.tokens, outcome.error) == ([want], None), row
            assert outcome.logprobs == [None] and outcome.candidates == [None]


# Rows whose first argmax is not the spec's token once the request's processor applies:
# token 1 leads and is the one penalised (then EOS wins); EOS leads and min_tokens bans
# it (then token 1 wins); the bias lifts token 0.
PENALISED = [0.0, 3.5, 1.0, 0.5, 0.0, 0.0, 3.0]
EOS_LEADS = [0.0, 3.0, 1.0, 0.5, 0.0, 0.0, 3.5]


@pytest.mark.parametrize(
    "params, output, row",
    [
        (SamplingParams(temperature=0.0, logit_bias={0: 100.0}), [], PENALISED),
        (SamplingParams(temperature=0.0, min_tokens=2), [1], EOS_LEADS),
        (SamplingParams(temperature=0.0, repetition_penalty=2.0), [1], PENALISED),
        (SamplingParams(temperature=0.0, presence_penalty=2.0), [1], PENALISED),
        (SamplingParams(temperature=0.0, frequency_penalty=2.0), [1], PENALISED),
        (SamplingParams(temperature=0.0, top_logprobs=1), [], PENALISED),
        (SamplingParams(temperature=1.0, seed=3), [], PENALISED),
    ],
    ids=["bias", "min_tokens", "repetition", "presence", "frequency", "logprobs", "sampled"],
)
def test_a_request_with_more_than_greedy_goes_the_whole_way(params, output, row):
    state = LogitsState(params, [0])
    assert not plain_greedy(state, output, Draft([]))
    want = spec_token(row, params, output)
    if params.temperature == 0 and not params.top_logprobs:  # the shortcut would differ
        assert want != max(range(VOCAB), key=row.__getitem__)
    (outcome,) = choose([row], [params], [output])
    assert outcome.tokens == [want]
    if params.top_logprobs:
        assert outcome.logprobs[0] is not None


def test_min_tokens_already_reached_is_plain_greedy():
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert not plain_greedy(LogitsState(params, [0]), [1], Draft([]))
    assert plain_greedy(LogitsState(params, [0]), [1, 2], Draft([]))
