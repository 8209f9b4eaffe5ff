"""The spec's parameter handling: SamplingParams, request checks, seeds, batch tensors."""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.checks import (
    ContextLengthError,
    ParameterTypeError,
    Range,
    check_range,
    check_token_ids,
)
from decodespec.spec.params import (
    PARAMETERS,
    RANGES,
    SamplingParams,
    SamplingTensors,
    resolve_seed,
    sampling_tensors,
    seed_to_int64,
    validate_request,
)
from decodespec.spec.sampling import InvalidLogitsError, sample

TINY = 2.0**-126  # the smallest normal float32
F32_MAX = float(torch.finfo(torch.float32).max)

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
    # NaN, ±inf, -0.0 and huge integers, wherever they are out of range
    ("temperature", -math.inf),
    ("top_p", -0.0),
    ("top_p", math.inf),
    ("min_p", math.nan),
    ("min_p", math.inf),
    ("repetition_penalty", -0.0),
    ("repetition_penalty", math.nan),
    ("frequency_penalty", math.inf),
    ("presence_penalty", -math.inf),
    ("logit_bias", {5: math.inf}),
    ("logit_bias", {5: -math.inf}),
    ("logit_bias", {5: 10**400}),
    ("top_k", -(2**70)),
    ("max_tokens", -(10**400)),
    ("seed", 2**64 + 5),
    ("seed", -(2**63)),
    ("top_logprobs", 2**64),
]


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_parameter_raises_naming_it(field, value):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert field.split("_")[0] in str(error.value)
    assert "must" in str(error.value)
    assert error.value.param == field  # a server names the field without reading the message


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


def test_sampling_tensors_select_rows_and_drop_the_seed_for_process_logits():
    params = [SamplingParams(seed=3, repetition_penalty=1.5), SamplingParams(temperature=0)]
    t = sampling_tensors(
        params, vocab_size=5, prompt_token_ids=[[0], [1]], output_token_ids=[[2], []]
    )
    assert dict(**t).keys() == t.keys() and "logit_bias" not in t and len(t) == len(list(t))
    picked = t.rows([1, 0])
    assert isinstance(picked, SamplingTensors) and picked.keys() == t.keys()
    for name, value in t.items():
        assert torch.equal(picked[name], value[[1, 0]]), name
    assert t.process_logits_args.keys() == t.keys() - {"seed"}
    with pytest.raises(KeyError):
        t["logit_bias"]


@pytest.mark.clause("PARAM-REQUEST-1")
@pytest.mark.parametrize(
    ("prompt", "fields", "param"),
    [
        ([1] * 8, {}, "prompt_token_ids"),
        ([1], {"max_tokens": 8}, "max_tokens"),
        ([1], {"max_tokens": None, "min_tokens": 8}, "min_tokens"),
    ],
)
def test_a_request_beyond_the_context_names_its_field(prompt, fields, param):
    with pytest.raises(ContextLengthError) as error:
        validate_request(SamplingParams(**fields), prompt, vocab_size=4, max_context=8)
    assert error.value.param == param and "context" in str(error.value)


def test_every_parameter_is_declared_once_with_its_range_and_interfaces():
    assert list(PARAMETERS) == [f.name for f in dataclasses.fields(SamplingParams)]
    for name, declared in PARAMETERS.items():
        assert declared.help, name
        if declared.type in (float, int) and name not in ("min_tokens", "seed"):
            assert RANGES[name] is declared.range, name
    assert RANGES["top_p"] == Range(0, 1, low_open=True) and str(RANGES["top_p"]) == "(0, 1]"
    assert {p.api for p in PARAMETERS.values()} >= {"temperature", "top_k", "logprobs_mode"}


def test_sampling_tensors_need_resolved_seeds():
    with pytest.raises(ValueError, match="seed"):
        sampling_tensors(
            [SamplingParams()], vocab_size=4, prompt_token_ids=[[0]], output_token_ids=[[]]
        )


# ---------------------------------------------------------------------------
# Types (PARAM-TYPE-1)

TYPE_ERRORS = [
    ("temperature", "0.5"),
    ("temperature", None),
    ("temperature", 1 + 0j),
    ("temperature", True),
    ("temperature", Decimal("0.5")),
    ("temperature", [1.0]),
    ("temperature", torch.tensor([1.0])),
    ("temperature", np.bool_(True)),
    ("top_k", 2.0),
    ("top_k", "3"),
    ("top_k", None),
    ("top_k", np.float64(2.0)),
    ("top_k", torch.tensor(2.5)),
    ("top_p", "1"),
    ("min_p", None),
    ("repetition_penalty", "1.1"),
    ("frequency_penalty", False),
    ("presence_penalty", 1j),
    ("logit_bias", None),
    ("logit_bias", [(1, 2.0)]),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {1.0: 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {1: "2"}),
    ("logit_bias", {1: None}),
    ("max_tokens", 16.0),
    ("max_tokens", "16"),
    ("min_tokens", None),
    ("min_tokens", 1.0),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    ("stop", None),
    ("stop", b"ab"),
    ("stop", 3),
    ("stop", ["a", 3]),
    ("stop", [None]),
    ("stop", {"a": 1}),
    ("stop", torch.tensor(0.5)),
    ("stop_token_ids", None),
    ("stop_token_ids", 3),
    ("stop_token_ids", "12"),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", torch.tensor([1.0])),
    ("ignore_eos", "false"),
    ("ignore_eos", 0),
    ("ignore_eos", None),
    ("top_logprobs", True),
    ("top_logprobs", 2.0),
    ("logprobs_mode", None),
    ("logprobs_mode", 1),
]


@pytest.mark.clause("PARAM-TYPE-1")
@pytest.mark.parametrize(("field", "value"), TYPE_ERRORS)
def test_wrong_type_raises_type_error_naming_it(field, value):
    with pytest.raises(TypeError) as error:
        SamplingParams(**{field: value})
    assert isinstance(error.value, ParameterTypeError)
    assert isinstance(error.value, ValueError)  # callers catching ValueError still report it
    assert field in str(error.value)
    assert error.value.param == field
    assert "must" in str(error.value)


@pytest.mark.clause("PARAM-TYPE-1")
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", "0.5", "temperature must be a real number, got '0.5' (str)"),
        ("temperature", None, "temperature must be a real number, got None (NoneType)"),
        ("top_k", 2.0, "top_k must be an integer, got 2.0 (float)"),
        ("ignore_eos", "false", "ignore_eos must be a bool, got 'false' (str)"),
        ("stop", None, "stop must be a str or a sequence of str, got None (NoneType)"),
        ("stop", ["a", 3], "stop[1] must be a str, got 3 (int)"),
        ("stop_token_ids", [1, 2.0], "stop_token_ids[1] must be an integer, got 2.0 (float)"),
        ("logit_bias", {"5": 1.0}, "logit_bias key must be an integer, got '5' (str)"),
        ("temperature", np.bool_(True), "got np.True_ (numpy.bool)"),
    ],
)
def test_type_error_messages(field, value, message):
    with pytest.raises(ParameterTypeError) as error:
        SamplingParams(**{field: value})
    assert message in str(error.value)


@pytest.mark.clause("PARAM-TYPE-1")
def test_numbers_of_other_real_and_integral_types_are_stored_as_python_numbers():
    params = SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(5),
        top_p=Fraction(9, 10),
        min_p=torch.tensor(0.25),
        repetition_penalty=np.float16(1.5),
        seed=np.uint64(2**64 - 1),
        max_tokens=torch.tensor(8),
        stop_token_ids=np.array([1, 2]),
        logit_bias={np.int32(3): np.float64(1.5), 4: 2},
        stop=["a", "b"],
        top_logprobs=np.int8(3),
    )
    assert (params.temperature, params.top_p, params.min_p) == (0.5, 0.9, 0.25)
    assert (params.top_k, params.seed, params.max_tokens) == (5, 2**64 - 1, 8)
    assert params.stop_token_ids == (1, 2) and params.stop == ("a", "b")
    assert params.logit_bias == {3: 1.5, 4: 2.0}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty"):
        assert type(getattr(params, name)) is float, name
    for name in ("top_k", "seed", "max_tokens", "min_tokens", "top_logprobs"):
        assert type(getattr(params, name)) is int, name
    assert all(type(k) is int and type(v) is float for k, v in params.logit_bias.items())
    assert all(type(t) is int for t in params.stop_token_ids)
    # The stored values pass validation again unchanged (dataclasses.replace re-runs it).
    assert resolve_seed(params, torch.Generator()) == params


@pytest.mark.clause("PARAM-TYPE-1")
def test_negative_zero_is_zero():
    params = SamplingParams(temperature=-0.0, min_p=-0.0, frequency_penalty=-0.0)
    assert all(
        math.copysign(1, v) == 1
        for v in (params.temperature, params.min_p, params.frequency_penalty)
    )


@pytest.mark.clause("PARAM-TYPE-1")
def test_check_range_rejects_scalars_that_are_not_real():
    with pytest.raises(ParameterTypeError, match="num_top must be a real number"):
        check_range("num_top", "3", 0, 20)
    with pytest.raises(ValueError, match=r"x must be in \[0, 1\], got <an integer of 1329 bits>"):
        check_range("x", 10**400, 0, 1)


# ---------------------------------------------------------------------------
# What the tensors can hold (PARAM-TENSOR-1)

TENSOR_ERRORS = [
    ("temperature", 1e39, "overflows to inf"),
    ("temperature", F32_MAX, "too large"),
    ("temperature", 2.0**127, "too large"),
    ("temperature", 10**400, "overflows to inf"),
    ("temperature", 1e-46, "underflows to 0"),
    ("temperature", 1e-40, "subnormal"),
    ("top_p", 1e-46, "underflows to 0"),
    ("top_p", 1e-40, "subnormal"),
    ("min_p", 1e-46, "underflows to 0"),
    ("min_p", 1e-40, "subnormal"),
    ("repetition_penalty", 1e300, "overflows to inf"),
    ("repetition_penalty", 1e38, "too large"),
    ("repetition_penalty", 1e-38, "subnormal"),
    ("repetition_penalty", 1e-46, "underflows to 0"),
    ("frequency_penalty", 1e-300, "underflows to 0"),
    ("presence_penalty", -1e-45, "subnormal"),
    ("logit_bias", {3: 1e-39}, "subnormal"),
    ("top_k", 2**63, "int64"),
    ("top_k", 10**30, "int64"),
    ("top_k", 10**4000, "int64"),
    ("max_tokens", 2**63, "int64"),
    ("stop_token_ids", [2**63], "int64"),
    ("logit_bias", {2**63: 1.0}, "int64"),
    ("stop_token_ids", [-1], ">= 0"),
    ("logit_bias", {-1: 1.0}, ">= 0"),
]


@pytest.mark.clause("PARAM-TENSOR-1", "PARAM-RANGE-1")
@pytest.mark.parametrize(("field", "value", "why"), TENSOR_ERRORS)
def test_values_the_tensors_cannot_hold_are_rejected(field, value, why):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert not isinstance(error.value, TypeError)
    message = str(error.value)
    assert field in message and why in message and "must" in message


@pytest.mark.clause("PARAM-TENSOR-1")
def test_a_vanishing_temperature_is_not_silently_greedy():
    with pytest.raises(ValueError) as error:
        SamplingParams(temperature=1e-46)
    assert str(error.value).startswith("temperature 1e-46 underflows to 0 in float32")
    assert str(error.value).endswith("use 0 for greedy")


@pytest.mark.clause("PARAM-TENSOR-1", "PARAM-RANGE-1")
def test_min_tokens_must_fit_an_int64_without_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=None, min_tokens=10**30)
    assert SamplingParams(max_tokens=None, min_tokens=2**63 - 1).min_tokens == 2**63 - 1


def _tensors(params: SamplingParams, vocab: int = 8) -> dict[str, torch.Tensor]:
    if params.seed is None:
        params = resolve_seed(params, torch.Generator().manual_seed(0))
    return sampling_tensors(
        [params],
        vocab_size=vocab,
        prompt_token_ids=[[0, 1, 2]],
        output_token_ids=[[1, 3, 3]],
        eos_token_ids=[vocab - 1],
    )


def _assert_tensors_hold(params: SamplingParams, tensors: dict[str, torch.Tensor]) -> None:
    """The float tensors are finite normal-or-zero float32s, the integers exact."""
    for name, t in tensors.items():
        if t.dtype.is_floating_point:
            assert bool(torch.isfinite(t).all()), (name, t)
            assert bool(((t == 0) | (t.abs() >= TINY)).all()), (name, t)
    for name in ("temperature", "repetition_penalty"):
        if name in tensors:
            t = tensors[name][tensors[name] > 0]
            reciprocal = 1 / t
            assert bool((torch.isfinite(reciprocal) & (reciprocal >= TINY)).all()), (name, t)
    assert tensors["top_k"].item() == params.top_k
    assert tensors["seed"].item() % 2**64 == (params.seed or 0) or params.seed is None
    if "min_tokens" in tensors:
        assert tensors["min_tokens"].item() == params.min_tokens
    if "logit_bias" in tensors:
        for token_id, bias in params.logit_bias.items():
            assert tensors["logit_bias"][0, token_id].item() == np.float32(bias)


EDGES = [
    dict(temperature=TINY),
    dict(temperature=TINY - 2.0**-151),  # rounds to the smallest normal float32
    dict(temperature=2.0**126),
    dict(temperature=-0.0),
    dict(top_p=TINY, min_p=TINY),
    dict(top_p=1.0, min_p=1.0),
    dict(repetition_penalty=TINY, frequency_penalty=-TINY, presence_penalty=2.0),
    dict(repetition_penalty=2.0**126, frequency_penalty=2.0, presence_penalty=-2.0),
    dict(top_k=2**63 - 1, seed=2**64 - 1),
    dict(seed=2**63, top_logprobs=20),
    dict(max_tokens=2**63 - 1, min_tokens=2**63 - 1),
    dict(max_tokens=None, min_tokens=2**63 - 1),
    dict(logit_bias={0: -TINY, 1: 100.0, 2: -100}, stop_token_ids=[6], min_tokens=1),
    dict(temperature=np.float32(0.5), top_k=np.int64(5), seed=np.uint64(2**64 - 1)),
]


@pytest.mark.clause("PARAM-TENSOR-1", "PARAM-RANGE-1")
@pytest.mark.parametrize("kwargs", EDGES)
def test_edge_values_are_accepted_and_their_tensors_are_finite(kwargs):
    params = SamplingParams(**kwargs)
    _assert_tensors_hold(params, _tensors(params))


@pytest.mark.clause("PARAM-TENSOR-1", "SAMPLE-VALID-1")
@pytest.mark.parametrize("temperature", [TINY, 2.0**126])
def test_extreme_temperatures_sample_from_finite_logits(temperature):
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(3)) * 30
    tensors = _tensors(SamplingParams(temperature=temperature, seed=5))
    token = sample(logits, **tensors)
    assert 0 <= token.item() < 8
    if temperature == TINY:  # every token but the maximum is infinitely far below it
        assert token.item() == logits.argmax().item()


@pytest.mark.clause("PARAM-TENSOR-1", "SAMPLE-VALID-1")
def test_a_tiny_repetition_penalty_that_overflows_a_logit_invalidates_its_row():
    """No bound on θ keeps z / θ finite: the overflow is caught at run time."""
    logits = torch.tensor([[8.0, -1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    tensors = _tensors(SamplingParams(temperature=0.0, repetition_penalty=TINY))
    with pytest.raises(InvalidLogitsError):
        sample(logits, **tensors)


FLOATS = st.one_of(
    st.floats(),  # NaN, ±inf, subnormals, huge
    st.floats(-3, 3),
    st.sampled_from([0.0, -0.0, TINY, TINY / 2, 2.0**126, 2.0**127, 1e-46, 1e39, 1.0, 100.0]),
    st.integers(-(2**70), 2**70),
)
INTS = st.one_of(
    st.integers(-(2**66), 2**66),
    st.integers(-2, 40),
    st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**400]),
    st.floats(0, 10),
    st.booleans(),
)


# Values of the right type around each valid range: its edges, subnormals and
# overflows included. The property test corrupts a few of them with anything.
FLOAT32_EDGES = [TINY, TINY / 2, 2.0**-150, 1e-46, 2.0**126, 2.0**127, F32_MAX, 1e39]
INT64_EDGES = [2**63 - 1, 2**63, 2**64 - 1, 2**64]


def _near(values: st.SearchStrategy, edges: list) -> st.SearchStrategy:
    return st.one_of(values, st.sampled_from(edges))


NEAR = {
    "temperature": _near(st.floats(0, 2.0**127), [0.0, -0.0, *FLOAT32_EDGES]),
    "top_k": _near(st.integers(0, 2**64), INT64_EDGES),
    "top_p": _near(st.floats(0, 1), [1.0, *FLOAT32_EDGES[:4]]),
    "min_p": _near(st.floats(0, 1), [0.0, 1.0, *FLOAT32_EDGES[:4]]),
    "repetition_penalty": _near(st.floats(0, 2.0**127, exclude_min=True), FLOAT32_EDGES),
    "frequency_penalty": _near(st.floats(-2, 2), [-2.0, 2.0, *FLOAT32_EDGES[:4]]),
    "presence_penalty": _near(st.floats(-2, 2), [-2.0, 2.0, -TINY / 2, -1e-46]),
    "logit_bias": st.dictionaries(
        st.integers(0, 7), _near(st.floats(-100, 100), FLOAT32_EDGES[:4]), max_size=3
    ),
    "max_tokens": st.one_of(st.none(), _near(st.integers(1, 2**64), INT64_EDGES)),
    "min_tokens": _near(st.integers(0, 2**64), INT64_EDGES),
    "seed": st.one_of(st.none(), _near(st.integers(0, 2**64), INT64_EDGES)),
    "stop_token_ids": st.lists(st.integers(0, 7), max_size=3),
    "ignore_eos": st.booleans(),
    "top_logprobs": st.one_of(st.none(), st.integers(0, 21)),
}
WILD = st.one_of(
    FLOATS,
    INTS,
    st.none(),
    st.text(max_size=2),
    st.dictionaries(INTS, FLOATS, max_size=2),
    st.lists(st.one_of(INTS, FLOATS), max_size=2),
)


@st.composite
def sampling_kwargs(draw: st.DrawFn) -> dict:
    kwargs = draw(st.fixed_dictionaries({}, optional=NEAR))
    for name in draw(st.lists(st.sampled_from(sorted(NEAR)), max_size=2)):
        kwargs[name] = draw(WILD)
    return kwargs


@pytest.mark.clause("PARAM-TENSOR-1", "PARAM-TYPE-1")
@given(kwargs=sampling_kwargs())
def test_any_params_that_construct_give_tensors_without_inf_nan_or_overflow(kwargs):
    try:
        params = SamplingParams(**kwargs)  # only ValueError (or its ParameterTypeError)
    except ValueError:
        return
    try:
        validate_request(params, [0, 1, 2], vocab_size=8, max_context=2**64)
    except ValueError:
        return
    tensors = _tensors(params)
    _assert_tensors_hold(params, tensors)
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0)) * 3
    try:
        sample(logits, **tensors)
    except InvalidLogitsError:
        # Only a penalty far from 1 or min_tokens banning the stop ids can do this.
        assert params.repetition_penalty != 1 or params.min_tokens > 0


# ---------------------------------------------------------------------------
# Token ids and the request (PARAM-REQUEST-1)


@pytest.mark.clause("PARAM-REQUEST-1", "PARAM-TYPE-1")
@pytest.mark.parametrize(
    ("prompt", "where"),
    [
        ([1.5, 2], "prompt_token_ids[0]"),
        (["12", 2], "prompt_token_ids[0]"),
        ([True, 2], "prompt_token_ids[0]"),
        ([1, None], "prompt_token_ids[1]"),
        ([1, [2]], "prompt_token_ids[1]"),
        ([1, np.float64(2.0)], "prompt_token_ids[1]"),
        (np.array([1.0, 2.0]), "prompt_token_ids[0]"),
        (torch.tensor([1.0, 2.0]), "prompt_token_ids must hold integer token ids"),
        (torch.tensor([True]), "prompt_token_ids must hold integer token ids"),
        ("hello", "prompt_token_ids must be a sequence"),
        (b"hello", "prompt_token_ids must be a sequence"),
        (None, "prompt_token_ids must be a sequence"),
        (5, "prompt_token_ids must be a sequence"),
    ],
)
def test_prompt_ids_of_the_wrong_type_are_rejected_by_index(prompt, where):
    with pytest.raises(ParameterTypeError) as error:
        validate_request(SamplingParams(), prompt, vocab_size=100, max_context=64)
    assert where in str(error.value)


@pytest.mark.clause("PARAM-REQUEST-1")
def test_prompt_tensor_must_be_one_dimensional():
    with pytest.raises(ValueError, match=r"prompt_token_ids must be 1-D, got .* \[1, 2\]"):
        validate_request(SamplingParams(), torch.tensor([[1, 2]]), vocab_size=100, max_context=64)


@pytest.mark.clause("PARAM-REQUEST-1")
@pytest.mark.parametrize(
    "ids",
    [
        [3, 1],
        (3, 1),
        np.array([3, 1]),
        torch.tensor([3, 1], dtype=torch.int32),
        torch.tensor([3, 1], dtype=torch.uint8),
        [torch.tensor(3), np.int16(1)],
    ],
)
def test_check_token_ids_returns_python_ints(ids):
    out = check_token_ids("prompt_ids", ids, vocab_size=4)
    assert out == [3, 1] and type(out) is list
    assert all(type(t) is int for t in out)


@pytest.mark.clause("PARAM-REQUEST-1")
def test_check_token_ids_names_the_first_id_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"ids outside the vocabulary \[0, 4\): \[4, -1\] "):
        check_token_ids("prompt_ids", [0, 4, 1, -1], vocab_size=4)
    with pytest.raises(ValueError, match="the first at index 1"):
        check_token_ids("prompt_ids", [0, 4, 1, -1], vocab_size=4)


@pytest.mark.clause("PARAM-REQUEST-1")
def test_min_tokens_must_be_reachable_within_the_context():
    params = SamplingParams(max_tokens=None, min_tokens=64)
    with pytest.raises(ValueError, match="min_tokens=64 with a 1-token prompt can never"):
        validate_request(params, [1], vocab_size=100, max_context=64)
    validate_request(
        SamplingParams(max_tokens=None, min_tokens=63), [1], vocab_size=100, max_context=64
    )


def test_validate_request_needs_sampling_params():
    with pytest.raises(ParameterTypeError, match="params must be a SamplingParams"):
        validate_request({"temperature": 1.0}, [1], vocab_size=100, max_context=64)
