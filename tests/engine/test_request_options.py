"""`RequestOptions`: a request's fields beyond `SamplingParams`, declared once and
checked once (`reference/request_options.py`)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from decodespec.reference.engine import Engine
from decodespec.reference.engine_loop import EngineLoop
from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.openai_api import COMMON_FIELDS, APIRequest
from decodespec.reference.request_options import (
    API_FIELDS,
    OPTIONS,
    RequestOptions,
    check_prompt_logprobs,
)
from decodespec.spec.checks import ParameterError, ParameterTypeError
from decodespec.spec.params import MAX_TOP_LOGPROBS, SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config

GOOD = [
    {},
    {"num_draft": 0},
    {"num_draft": 7},
    {"prompt_logprobs": 0},
    {"prompt_logprobs": MAX_TOP_LOGPROBS},
    {"structured_output": StructuredOutput("regex", source="a+", field="t")},
    {"arrival": 12.5},
    {"arrival": 3},
]

BAD = [
    # (fields, the error's type, the field it names)
    ({"num_draft": -1}, ParameterError, "num_draft"),
    ({"num_draft": True}, ParameterTypeError, "num_draft"),
    ({"num_draft": "2"}, ParameterTypeError, "num_draft"),
    ({"num_draft": 2.0}, ParameterTypeError, "num_draft"),
    ({"prompt_logprobs": -1}, ParameterError, "prompt_logprobs"),
    ({"prompt_logprobs": MAX_TOP_LOGPROBS + 1}, ParameterError, "prompt_logprobs"),
    ({"prompt_logprobs": False}, ParameterTypeError, "prompt_logprobs"),
    ({"prompt_logprobs": 1.5}, ParameterTypeError, "prompt_logprobs"),
    ({"structured_output": "a+"}, ParameterTypeError, "structured_output"),
    ({"structured_output": {"regex": "a+"}}, ParameterTypeError, "structured_output"),
    ({"arrival": math.nan}, ParameterError, "arrival"),
    ({"arrival": math.inf}, ParameterError, "arrival"),
    ({"arrival": "now"}, ParameterTypeError, "arrival"),
]


@pytest.mark.parametrize("fields", GOOD, ids=repr)
def test_valid_options_are_kept_as_given(fields):
    options = RequestOptions(**fields)
    for name, value in fields.items():
        assert getattr(options, name) == value


@pytest.mark.parametrize(("fields", "error", "param"), BAD, ids=repr)
def test_an_invalid_option_is_refused_naming_its_field(fields, error, param):
    """Every value is checked where the options are built, as `SamplingParams` checks
    its fields: the error is a `ParameterError` (a ValueError; a wrong type is a
    TypeError too) whose `.param` and message name the field."""
    with pytest.raises(error) as caught:
        RequestOptions(**fields)
    assert caught.value.param == param
    assert param in str(caught.value)


def test_every_option_is_declared_with_help():
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(RequestOptions)}
    for name, declared in OPTIONS.items():
        assert len(declared.help) > 20, f"{name}: declare what it does"


def test_the_server_takes_the_options_the_declarations_name():
    """The body fields come from the declarations: `num_draft` by its declared name."""
    assert API_FIELDS == {"num_draft": "num_draft"}
    assert set(API_FIELDS) <= COMMON_FIELDS


def test_the_request_fields_are_spelled_in_one_place():
    """`Engine.add_request`, `Engine.generate`, `EngineLoop.submit` and `APIRequest`
    take one `RequestOptions`, never an option's own argument (issue 39: the fields
    were spelled in four signatures and checked twice)."""
    options = set(OPTIONS)
    for function in (Engine.add_request, Engine.generate, EngineLoop.submit):
        parameters = set(inspect.signature(function).parameters)
        assert not parameters & options, f"{function.__qualname__} spells {parameters & options}"
        assert "options" in parameters
    api_fields = {f.name for f in dataclasses.fields(APIRequest)}
    assert not api_fields & options
    assert "options" in api_fields


def small_model(seed: int):
    return random_weights(small_config(max_context=64), seed=seed)


@pytest.mark.parametrize("value", [0, 5, MAX_TOP_LOGPROBS])
def test_check_prompt_logprobs_keeps_a_valid_k(value):
    assert check_prompt_logprobs(value) == value


def test_the_engine_refuses_drafts_it_cannot_make():
    """What depends on the engine is checked by it: a num_draft above its K, or any
    drafts at all without a drafter, names num_draft."""
    params = SamplingParams(temperature=0, max_tokens=2)
    weights = small_model(1)
    plain = Engine(weights, ByteTokenizer())
    with pytest.raises(ParameterError, match="no drafter") as caught:
        plain.add_request([1, 2], params, RequestOptions(num_draft=1))
    assert caught.value.param == "num_draft"
    plain.add_request([1, 2], params, RequestOptions(num_draft=0))  # no drafts: fine
    drafting = Engine(weights, ByteTokenizer(), speculate="ngram", num_draft=3)
    with pytest.raises(ParameterError, match=r"num_draft must be in \[0, 3\], got 4"):
        drafting.add_request([1, 2], params, RequestOptions(num_draft=4))
    drafting.add_request([1, 2], params, RequestOptions(num_draft=3))
    with pytest.raises(TypeError, match="options must be a RequestOptions"):
        drafting.add_request([1, 2], params, {"num_draft": 1})


def test_the_engine_sets_the_arrival_once():
    """No arrival: the engine takes the request's arrival to be when it was added;
    a given one is kept (a server's, when the request came in)."""
    engine = Engine(small_model(1), ByteTokenizer())
    params = SamplingParams(temperature=0, max_tokens=1)
    given = engine.add_request([1], params, RequestOptions(arrival=5.0))
    assert engine.requests[given].arrival == 5.0
    drawn = engine.add_request([1], params)
    assert engine.requests[drawn].options.arrival is not None
    assert engine.requests[drawn].options.arrival > 5.0
