"""Structured outputs through the HTTP API, on a small random model: OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`, bad grammars
refused with a 400 naming the field before any model work, and the grammar's
removed alternatives marked in the logprobs.

(The official client's `parse` helper against the bundled model is in
`test_openai_client.py`.)
"""

from __future__ import annotations

import json
import re

import pytest

from decodespec.reference.structured_api import parse_structured_output
from tests.serve.test_api import CHAT, check_error, client, engine, sse_payloads, weights

__all__ = ["client", "engine", "weights"]  # the fixtures this module uses

BAD = [
    # (extra body fields, param at fault, a word of the message)
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format",
        "name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format",
        "object",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objec"}},
            }
        },
        "response_format.json_schema.schema",
        "objec",
    ),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": 'root ::= ("a"'}}, "structured_outputs.grammar", "EBNF"),
    (
        {"structured_outputs": {"grammar": 'root ::= root "a"'}},
        "structured_outputs.grammar",
        "admits no string",
    ),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice", "array"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs", "yaml"),
    ({"structured_outputs": {"regex": "a" * 70_000}}, "structured_outputs.regex", "at most"),
    ({"guided_json": 5}, "guided_json", "JSON Schema"),
    ({"guided_regex": "[z-a]"}, "guided_regex", ""),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "not both",
    ),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    # MASK-SOUND-1: a keyword the grammar library would not enforce, named with its place
    (
        {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
        "structured_outputs.json",
        "'uniqueItems' at /",
    ),
    # OpenAI's strict rules, with the JSON pointer of the object at fault
    *(
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "strict": True, "schema": schema}}},
            "response_format.json_schema.schema",
            word,
        )
        for schema, word in [
            ({"type": "array"}, "the root must be an object"),
            (
                {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                "'additionalProperties' must be false at /",
            ),
            (
                {"type": "object", "additionalProperties": False, "required": ["a"],
                 "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}},
                                      "additionalProperties": False}}},
                "'required' at /properties/a must list every property; 'b' is missing",
            ),
        ]
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param", "word"), BAD)
@pytest.mark.parametrize("route", ["chat", "completion"])
def test_a_bad_structured_output_is_a_400_naming_the_field(client, fields, param, word, route):
    body = {"messages": CHAT} if route == "chat" else {"prompt": "hi"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    error = check_error(client.post(path, json={**body, **fields}), 400, param, None)
    assert word in error["message"], error
    # The server goes on: the next request is answered.
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def chat(client, **fields) -> dict:
    response = client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "temperature": 1.0, "seed": 7, "max_tokens": 40, **fields},
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.mark.parametrize(
    ("fields", "fits"),
    [
        (
            {"structured_outputs": {"choice": ["red", "green", "blue"]}},
            lambda text: text in ("red", "green", "blue"),
        ),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
        (
            {"structured_outputs": {"regex": "[0-9]{2,4}-[a-c]"}},
            lambda text: re.fullmatch("[0-9]{2,4}-[a-c]", text),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "<" ("x" | "y")+ ">"'}},
            lambda text: re.fullmatch("<[xy]+>", text),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}},
                }
            },
            lambda text: json.loads(text) in ("yes", "no"),
        ),
        (
            {"structured_outputs": {"json": {"type": "boolean"}}},
            lambda text: isinstance(json.loads(text), bool),
        ),
    ],
)
def test_a_constrained_answer_fits_its_grammar(client, fields, fits):
    """A random model writes random bytes unless constrained: every answer that ends
    with the grammar's stop token fits it."""
    finished = 0
    for seed in range(3):
        choice = chat(client, **fields, seed=seed)
        if choice["finish_reason"] == "stop":
            assert fits(choice["message"]["content"]), choice
            finished += 1
    assert finished, "no answer reached the grammar's end: the test shows nothing"
    assert chat(client, seed=0)["finish_reason"] == "length"  # unconstrained: noise


def test_response_format_text_is_unconstrained(client):
    plain = chat(client)
    assert chat(client, response_format={"type": "text"}) == plain


def test_a_streamed_constrained_answer_marks_the_alternatives_the_grammar_removed(client):
    fields = {"structured_outputs": {"choice": ["abc", "abd"]}, "logprobs": True}
    response = client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 8, "stream": True, "top_logprobs": 5, **fields},
    )
    assert response.status_code == 200, response.text
    chunks = [p for p in sse_payloads(response.text) if p != "[DONE]" and p["choices"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text in ("abc", "abd")
    entries = [
        e
        for c in chunks
        if c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    first = entries[0]
    # After nothing, only "a" is allowed: every other alternative was removed.
    assert [alt["allowed"] for alt in first["top_logprobs"]] == [
        alt["token"] == "a" for alt in first["top_logprobs"]
    ]
    plain = client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 5},
    ).json()
    assert all(
        "allowed" not in alt
        for entry in plain["choices"][0]["logprobs"]["content"]
        for alt in entry["top_logprobs"]
    )


def test_json_schema_without_a_schema_is_any_json_value(client):
    # OpenAI's json_schema.schema is optional: without it the answer is any JSON value
    # (the empty schema), strict or not.
    for strict in (True, False):
        fields = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "any", "strict": strict},
            }
        }
        output = parse_structured_output(fields)
        assert (output.kind, json.loads(output.source)) == ("json_schema", {})
        assert chat(client, **fields)["finish_reason"] in ("stop", "length")


def test_a_strict_schema_that_follows_openais_rules_is_accepted(client):
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"]},
            "b": {"type": "array", "items": {
                "type": "object", "properties": {"c": {"enum": [1, 2]}}, "required": ["c"],
                "additionalProperties": False}},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    }  # fmt: skip
    fields = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "strict": True, "schema": schema},
        }
    }
    assert chat(client, **fields)["finish_reason"] in ("stop", "length")
