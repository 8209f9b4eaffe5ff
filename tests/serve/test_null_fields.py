"""Optional request fields set to null (or a boolean flag set to false) mean "not
given", as OpenAI and vLLM read them: the answer is the one without the field.
A wrong non-null type is still a 400 naming the field.

Every optional field the endpoints take (`FIELDS`) is sent as null, so a field
added later is covered too. The app runs in-process, as in `test_api.py`.
"""

from __future__ import annotations

import pytest

from decodespec.reference.openai_api import FIELDS, APIRequest, parse_request
from tests.serve.test_api import (
    CHAT,
    MODEL,
    ChatByteTokenizer,
    check_error,
    client,
    engine,
    sse_payloads,
    weights,
)

__all__ = ["client", "engine", "weights"]  # the fixtures this module uses

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
# Sampled (temperature 0.9) under a fixed seed: the same request gives the same tokens.
BASE = {
    "completion": {"prompt": "hi", "max_tokens": 4, "seed": 7, "temperature": 0.9},
    "chat": {"messages": CHAT, "max_tokens": 4, "seed": 7, "temperature": 0.9},
}
REQUIRED = {"prompt", "messages"}
OPTIONAL = {kind: sorted(FIELDS[kind] - REQUIRED) for kind in ROUTES}


def parsed(kind: str, body: dict) -> APIRequest:
    return parse_request(
        body, kind, tokenizer=ChatByteTokenizer(), model=MODEL, vocab_size=260, max_context=96
    )


def answer(client, kind: str, body: dict) -> dict:
    """What must not depend on a null field: the choices, the seed, the token counts
    (not the id, the timings, or the prefix cache's `cached_tokens`)."""
    response = client.post(ROUTES[kind], json=body)
    assert response.status_code == 200, (body, response.text)
    if body.get("stream"):
        chunks = sse_payloads(response.text)[:-1]
        return {"chunks": [c["choices"] for c in chunks], "seed": chunks[-1].get("seed")}
    out = response.json()
    usage = {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return {"choices": out["choices"], "seed": out["seed"], "usage": usage}


def without(body: dict, names: object) -> dict:
    return {k: v for k, v in body.items() if k not in names}


@pytest.mark.parametrize(
    ("kind", "name"), [(kind, name) for kind in ROUTES for name in OPTIONAL[kind]]
)
def test_a_null_field_parses_as_a_field_not_given(kind, name):
    """Each optional field alone, null: the parsed request (prompt, sampling
    parameters, structured output, scoring) is the one without it."""
    base = without(BASE[kind], {name})
    assert parsed(kind, {**base, name: None}) == parsed(kind, base)


@pytest.mark.parametrize("kind", ROUTES)
def test_null_fields_answer_as_fields_not_given(client, kind):
    """Every optional field null at once, over HTTP: the same tokens; with the seed
    null, a drawn seed and (greedy) the same tokens again."""
    nulls = {name: None for name in OPTIONAL[kind]}
    for base in (BASE[kind], {**without(BASE[kind], {"seed"}), "temperature": 0}):
        plain = answer(client, kind, base)
        null = answer(client, kind, {**nulls, **base})
        if "seed" not in base:
            assert isinstance(plain.pop("seed"), int) and isinstance(null.pop("seed"), int)
        assert null == plain


NOT_GIVEN = [
    # (kind, fields that mean "not given", the request without them)
    ("completion", {"stream": False}, {}),
    ("completion", {"echo": False}, {}),
    ("completion", {"ignore_eos": False}, {}),
    ("chat", {"logprobs": False}, {}),
    ("chat", {"logprobs": False, "top_logprobs": None}, {}),
    ("chat", {"stream": False, "stream_options": None}, {}),
    ("completion", {"stream": False, "stream_options": {"include_usage": None}}, {}),
    ("completion", {"stream": True, "stream_options": {"include_usage": None}}, {"stream": True}),
    ("chat", {"stream": True, "stream_options": {"include_usage": None}}, {"stream": True}),
    ("completion", {"max_tokens": None, "echo": None}, {"max_tokens": 16}),  # OpenAI's default
    ("chat", {"max_completion_tokens": None, "max_tokens": 3}, {"max_tokens": 3}),
    ("chat", {"max_completion_tokens": 3, "max_tokens": None}, {"max_completion_tokens": 3}),
    # structured outputs: `json_object: false` and nulls inside structured_outputs
    *(
        (kind, {"structured_outputs": {"regex": "[ab]+", **extra}},
         {"structured_outputs": {"regex": "[ab]+"}})
        for kind in ROUTES
        for extra in (
            {"json_object": False},
            {"json_object": None},
            {"json": None, "choice": None, "grammar": None, "json_object": False},
        )
    ),
    ("chat", {"structured_outputs": {"choice": ["yes", "no"], "regex": None}},
     {"structured_outputs": {"choice": ["yes", "no"]}}),
    ("completion", {"guided_regex": "[ab]+", "guided_json": None, "response_format": None},
     {"guided_regex": "[ab]+"}),
    ("chat", {"guided_choice": ["x", "y"], "structured_outputs": None},
     {"guided_choice": ["x", "y"]}),
    # response_format text asks for no constraint: it does not clash with another kind
    ("chat", {"response_format": {"type": "text"}, "guided_regex": "[ab]+"},
     {"guided_regex": "[ab]+"}),
    ("completion", {"response_format": {"type": "text"}}, {}),
    # a null schema is no schema (any JSON value), strict or not
    *(
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": None, **strict}}},
         {"response_format": {"type": "json_schema", "json_schema": {"name": "x", **strict}}})
        for strict in ({}, {"strict": None}, {"strict": True})
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "fields", "same_as"), NOT_GIVEN, ids=repr)
def test_false_flags_and_nested_nulls_parse_as_not_given(kind, fields, same_as):
    base = BASE[kind]
    assert parsed(kind, {**base, **fields}) == parsed(kind, {**without(base, fields), **same_as})


@pytest.mark.parametrize(
    ("kind", "fields", "same_as"),
    [
        (
            "completion",
            {"stream": True, "stream_options": {"include_usage": None}},
            {"stream": True},
        ),
        (
            "chat",
            {"response_format": {"type": "text"}, "guided_regex": "[ab]+"},
            {"guided_regex": "[ab]+"},
        ),
    ],
    ids=repr,
)
def test_false_flags_and_nested_nulls_answer_as_not_given(client, kind, fields, same_as):
    base = BASE[kind]
    plain = {**without(base, fields), **same_as}
    assert answer(client, kind, {**base, **fields}) == answer(client, kind, plain)


@pytest.mark.parametrize("kind", ROUTES)
def test_a_regex_with_json_object_false_is_a_regex_request(client, kind):
    """`{"regex": ..., "json_object": false}` is one kind, not two refused together,
    and the regex holds; the answer is the regex request's."""
    regex = {"structured_outputs": {"regex": "[ab]{3}"}}
    flagged = {"structured_outputs": {"regex": "[ab]{3}", "json_object": False}}
    got = answer(client, kind, {**BASE[kind], **flagged})
    assert got == answer(client, kind, {**BASE[kind], **regex})
    choice = got["choices"][0]
    text = choice["text"] if kind == "completion" else choice["message"]["content"]
    assert len(text) == 3 and set(text) <= set("ab"), text


WRONG = [
    # (kind, fields, param): a wrong type that is not null is still refused
    ("completion", {"structured_outputs": {"regex": False}}, "structured_outputs.regex"),
    ("completion", {"structured_outputs": {"regex": False, "choice": ["a"]}},
     "structured_outputs"),  # two kinds: false is not "not given" but for json_object
    ("completion", {"structured_outputs": {"json": False, "regex": None}},
     "structured_outputs.json"),
    ("chat", {"structured_outputs": {"choice": False}}, "structured_outputs.choice"),
    ("chat", {"structured_outputs": {"json_object": "false"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"json_object": 0}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"json_object": False}}, "structured_outputs"),  # none left
    ("chat", {"structured_outputs": {"json_object": True, "regex": "a"}}, "structured_outputs"),
    ("completion", {"guided_regex": False}, "guided_regex"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "{}"}}}, "response_format"),
    ("completion", {"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("completion", {"stream": True, "stream_options": {"include_usage": 0}},
     "stream_options.include_usage"),
    ("completion", {"stream_options": {"include_usage": False}}, "stream_options"),
    ("completion", {"stream": "false"}, "stream"),
    ("completion", {"echo": 0}, "echo"),
    ("completion", {"ignore_eos": "false"}, "ignore_eos"),
    ("chat", {"logprobs": 0}, "logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("completion", {"logprobs": False}, "logprobs"),
    ("completion", {"seed": False}, "seed"),
    ("completion", {"n": False}, "n"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "fields", "param"), WRONG, ids=repr)
def test_a_wrong_type_that_is_not_null_is_a_400_naming_the_field(client, kind, fields, param):
    body = {**BASE[kind], **fields}
    check_error(client.post(ROUTES[kind], json=body), 400, param, None)
