"""The spec's parameter handling: SamplingParams, request checks, seeds, batch tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.sampling import (
    SamplingParams,
    resolve_seed,
    sample,
    sampling_tensors,
    seed_to_int64,
    validate_request,
)

INVALID = [
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_k", -1),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.000001),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 2.0),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", -3.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", math.nan),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {"a": 1.0}),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("seed", -1),
    ("seed", 2**64),
    ("stop", [""]),
    ("stop", [3]),
    ("top_logprobs", -1),
    ("top_logprobs", 21),
    ("logprobs_mode", "final"),
]


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_parameter_raises_naming_it(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert field.split("_")[0] in str(error.value)
    assert "must" in str(error.value)


@pytest.mark.clause("PARAM-RANGE-1")
def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=None, min_tokens=10**6).min_tokens == 10**6


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.0),
        dict(temperature=1e-30, top_k=10**9),
        dict(top_p=1.0, min_p=1.0),
        dict(repetition_penalty=1e-3, frequency_penalty=-2.0, presence_penalty=2.0),
        dict(logit_bias={0: -100.0, 1: 100}, seed=2**64 - 1, top_logprobs=20),
        dict(stop="###", max_tokens=None),
    ],
)
def test_boundary_values_are_accepted(params):
    SamplingParams(**params)


@pytest.mark.clause("PARAM-REQUEST-1")
@pytest.mark.parametrize(
    ("params", "prompt", "match"),
    [
        (SamplingParams(), [0, 100], "prompt_token_ids"),
        (SamplingParams(), [-1], "prompt_token_ids"),
        (SamplingParams(), [], "at least one"),
        (SamplingParams(logit_bias={100: 1.0}), [1], "logit_bias"),
        (SamplingParams(stop_token_ids=[100]), [1], "stop_token_ids"),
        (SamplingParams(max_tokens=8), [1] * 60, "max_tokens"),
        (SamplingParams(max_tokens=None), [1] * 64, "no room"),
    ],
)
def test_request_checked_against_the_model(params, prompt, match):
    with pytest.raises(ValueError, match=match):
        validate_request(params, prompt, vocab_size=100, max_context=64)


@pytest.mark.clause("PARAM-REQUEST-1")
def test_request_that_fits_is_accepted():
    validate_request(SamplingParams(max_tokens=4), [1] * 60, vocab_size=100, max_context=64)
    validate_request(SamplingParams(max_tokens=None), [1] * 63, vocab_size=100, max_context=64)


@pytest.mark.clause("SAMPLE-SEED-1")
def test_unseeded_request_gets_a_reported_reproducible_seed():
    g1 = torch.Generator().manual_seed(7)
    g2 = torch.Generator().manual_seed(7)
    a = resolve_seed(SamplingParams(), g1)
    b = resolve_seed(SamplingParams(), g2)
    c = resolve_seed(SamplingParams(), g1)
    assert a.seed is not None and 0 <= a.seed < 2**64
    assert a.seed == b.seed and a.seed != c.seed
    assert resolve_seed(SamplingParams(seed=5), g1).seed == 5


@pytest.mark.clause("SAMPLE-SEED-1", "SAMPLE-RNG-3")
def test_replaying_a_reported_seed_replays_the_tokens():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = resolve_seed(SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    first = sample(
        logits,
        **sampling_tensors([params], vocab_size=50, prompt_token_ids=[[1]], output_token_ids=[[]]),
    )
    replay = SamplingParams(temperature=1.0, seed=params.seed)
    again = sample(
        logits,
        **sampling_tensors([replay], vocab_size=50, prompt_token_ids=[[1]], output_token_ids=[[]]),
    )
    assert torch.equal(first, again)


@pytest.mark.clause("SAMPLE-RNG-2")
@given(seed=st.integers(0, 2**64 - 1))
def test_seed_bit_pattern_round_trips(seed):
    assert seed_to_int64(seed) % 2**64 == seed
    assert -(2**63) <= seed_to_int64(seed) < 2**63


@pytest.mark.clause("LOGITS-MINTOK-1", "LOGITS-REP-1", "LOGITS-BIAS-1")
def test_sampling_tensors_build_the_dense_rows():
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]),
        SamplingParams(
            seed=9, repetition_penalty=1.5, logit_bias={4: -5.0}, ignore_eos=True, min_tokens=1
        ),
    ]
    t = sampling_tensors(
        params,
        vocab_size=6,
        prompt_token_ids=[[0, 1], [2]],
        output_token_ids=[[5, 5], [1]],
        eos_token_ids=[0],
    )
    assert t["step"].tolist() == [2, 1]
    assert t["seed"].tolist() == [0, 9]
    assert t["stop_token_mask"].tolist() == [
        [True, False, False, True, False, False],
        [False] * 6,  # ignore_eos and no stop ids
    ]
    assert t["prompt_mask"].tolist()[1] == [False, False, True, False, False, False]
    assert t["output_counts"].tolist()[0] == [0, 0, 0, 0, 0, 2]
    assert t["logit_bias"][1, 4].item() == -5.0
    plain = sampling_tensors(
        [SamplingParams(seed=1)], vocab_size=6, prompt_token_ids=[[0]], output_token_ids=[[]]
    )
    assert set(plain) == {"temperature", "top_k", "top_p", "min_p", "seed", "step"}


def test_sampling_tensors_need_resolved_seeds():
    with pytest.raises(ValueError, match="seed"):
        sampling_tensors(
            [SamplingParams()], vocab_size=4, prompt_token_ids=[[0]], output_token_ids=[[]]
        )
