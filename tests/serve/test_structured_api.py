"""Structured outputs in a request body: OpenAI's `response_format`, vLLM's
`structured_outputs` and `guided_*`.

First `parse_structured_output` (reference/structured_api.py) on its own: each
accepted spelling and the `StructuredOutput` it gives (kind, source or choices,
and the field errors name), what counts as not given, and each refusal, a
`GrammarError` whose `.param` names the field at fault. Then the same fields
through the HTTP API, on a small random model: bad grammars refused with a 400
naming the field before any model work, constrained answers that fit their
grammars, and the grammar's removed alternatives marked in the logprobs.

(The official client's `parse` helper against the bundled model is in
`test_openai_client.py`; top-level nulls, which the request parser drops before
this module sees them, in `test_null_fields.py`.)
"""

from __future__ import annotations

import json
import re

import pytest

from decodespec.reference.grammar import MAX_SOURCE_BYTES, GrammarError, StructuredOutput
from decodespec.reference.structured_api import FIELDS, parse_structured_output
from tests.serve.test_api import CHAT, check_error, client, engine, sse_payloads, weights

__all__ = ["client", "engine", "weights"]  # the fixtures this module uses

# ---------------------------------------------------------------- parse_structured_output

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def refusal(body: dict) -> GrammarError:
    """The error `parse_structured_output` raises for `body`."""
    with pytest.raises(GrammarError) as error:
        parse_structured_output(body)
    return error.value


def test_fields_are_every_spelling_in_the_order_they_are_named():
    # The request parser takes these as known fields (openai_api.py); a clash names the
    # later one in this order, whatever the body's order.
    assert FIELDS == (
        "response_format", "structured_outputs",
        "guided_json", "guided_regex", "guided_grammar", "guided_choice",
    )  # fmt: skip


@pytest.mark.parametrize(
    "body",
    [{}, {"prompt": "hi", "max_tokens": 3}, dict.fromkeys(FIELDS)],
    ids=["empty", "other fields", "every field null"],
)
def test_a_body_without_structured_output_gives_none(body):
    assert parse_structured_output(body) is None


ACCEPTED = [
    # (body, the structured output it asks for)
    ({"response_format": {"type": "json_object"}},
     StructuredOutput("json_object", field="response_format")),
    ({"structured_outputs": {"json_object": True}},
     StructuredOutput("json_object", field="structured_outputs.json_object")),
    ({"structured_outputs": {"regex": "[ab]+"}},
     StructuredOutput("regex", source="[ab]+", field="structured_outputs.regex")),
    ({"guided_regex": "[ab]+"}, StructuredOutput("regex", source="[ab]+", field="guided_regex")),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}},
     StructuredOutput("grammar", source='root ::= "a"', field="structured_outputs.grammar")),
    ({"guided_grammar": 'root ::= "a"'},
     StructuredOutput("grammar", source='root ::= "a"', field="guided_grammar")),
    ({"structured_outputs": {"choice": ["yes", "no"]}},
     StructuredOutput("choice", choices=("yes", "no"), field="structured_outputs.choice")),
    ({"guided_choice": ["yes", "no"]},
     StructuredOutput("choice", choices=("yes", "no"), field="guided_choice")),
    # vLLM's schema may be JSON text: kept as given
    ({"structured_outputs": {"json": '{"type": "integer"}'}},
     StructuredOutput("json_schema", source='{"type": "integer"}',
                      field="structured_outputs.json")),
    ({"guided_json": '{"type": "integer"}'},
     StructuredOutput("json_schema", source='{"type": "integer"}', field="guided_json")),
]  # fmt: skip


@pytest.mark.parametrize(("body", "expected"), ACCEPTED, ids=repr)
def test_each_spelling_gives_its_structured_output(body, expected):
    assert parse_structured_output(body) == expected


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "description": "an answer", "schema": SCHEMA}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json"),
        ({"guided_json": SCHEMA}, "guided_json"),
    ],
    ids=repr,
)  # fmt: skip
def test_a_schema_given_as_an_object_is_its_json_text(body, field):
    output = parse_structured_output(body)
    assert (output.kind, output.field, output.choices) == ("json_schema", field, ())
    assert json.loads(output.source) == SCHEMA


@pytest.mark.parametrize("strict", [{}, {"strict": None}, {"strict": False}, {"strict": True}])
@pytest.mark.parametrize("schema", [{}, {"schema": None}], ids=["no schema", "null schema"])
def test_json_schema_without_a_schema_is_any_json_value(schema, strict):
    # OpenAI's json_schema.schema is optional: without it (or null) the answer is any JSON
    # value (the empty schema), strict or not.
    body = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "any", **schema, **strict}}}  # fmt: skip
    output = parse_structured_output(body)
    assert (output.kind, output.field) == ("json_schema", "response_format.json_schema.schema")
    assert json.loads(output.source) == {}


@pytest.mark.parametrize(
    "extra",
    [
        {"json": None, "choice": None, "grammar": None},
        {"json_object": None},
        {"json_object": False},
        {"json": None, "json_object": False},
    ],
    ids=repr,
)
def test_nulls_and_json_object_false_inside_structured_outputs_are_not_given(extra):
    # as vLLM's and OpenAI's clients may send them: `{"regex": "a+", "json_object": false}`
    # is a regex
    body = {"structured_outputs": {"regex": "a+", **extra}}
    expected = StructuredOutput("regex", source="a+", field="structured_outputs.regex")
    assert parse_structured_output(body) == expected


def test_a_null_field_beside_another_is_not_given():
    body = {**dict.fromkeys(FIELDS), "guided_choice": ["x", "y"]}
    expected = StructuredOutput("choice", choices=("x", "y"), field="guided_choice")
    assert parse_structured_output(body) == expected


def test_response_format_text_asks_for_no_constraint_and_clashes_with_nothing():
    assert parse_structured_output({"response_format": {"type": "text"}}) is None
    body = {"response_format": {"type": "text"}, "guided_regex": "a+"}
    assert parse_structured_output(body) == StructuredOutput(
        "regex", source="a+", field="guided_regex"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),  # FIELDS' order
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
          "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ],
    ids=repr,
)  # fmt: skip
def test_two_fields_are_refused_naming_the_later_one(body, param):
    error = refusal(body)
    assert error.param == param
    first = next(name for name in FIELDS if name in body)
    assert str(error) == f"give one of {first} and {param}, not both"


def test_three_fields_are_refused_naming_each():
    body = {"guided_regex": "a", "guided_json": SCHEMA, "response_format": {"type": "json_object"}}
    error = refusal(body)
    assert error.param == "guided_json"
    assert "response_format and guided_json and guided_regex" in str(error)


def test_the_grammar_is_not_compiled_here():
    # Its errors are raised by the engine when the request is added (GrammarCompiler.compile).
    assert parse_structured_output({"guided_regex": "a(b"}).source == "a(b"
    grammar = {"structured_outputs": {"grammar": 'root ::= ("a"'}}
    assert parse_structured_output(grammar).source == 'root ::= ("a"'
    schema = parse_structured_output({"guided_json": {"type": "objec"}})
    assert json.loads(schema.source) == {"type": "objec"}


def json_schema(**spec) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": spec}}


MALFORMED_RESPONSE_FORMAT = [
    # (response_format, a part of the message); the param is always response_format
    ("json", "response_format must be an object"),
    (["json_object"], "response_format must be an object"),
    ({}, "response_format.type must be 'text', 'json_object' or 'json_schema', got None"),
    ({"type": "xml"}, "got 'xml'"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema must be an object"),
    (json_schema(schema={})["response_format"], "response_format.json_schema.name is required"),
    (json_schema(name="", schema={})["response_format"], "name is required"),
    (json_schema(name=5, schema={})["response_format"], "name is required"),
    (json_schema(name="x", strict="yes")["response_format"],
     "response_format.json_schema.strict must be a boolean"),
    (json_schema(name="x", strict=1)["response_format"], "strict must be a boolean"),
    (json_schema(name="x", schema=[])["response_format"],
     "response_format.json_schema.schema must be an object"),
    # unlike vLLM's spellings, OpenAI's schema is an object, never its text
    (json_schema(name="x", schema="{}")["response_format"], "schema must be an object"),
]  # fmt: skip


@pytest.mark.parametrize(("value", "words"), MALFORMED_RESPONSE_FORMAT, ids=repr)
def test_a_malformed_response_format_is_refused_naming_it(value, words):
    error = refusal({"response_format": value})
    assert error.param == "response_format"
    assert words in str(error)


MALFORMED_VLLM = [
    # (body, param at fault, a part of the message)
    ({"structured_outputs": "a+"}, "structured_outputs", "structured_outputs must be an object"),
    ({"structured_outputs": ["a+"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"yaml": "a", "regex": "a"}}, "structured_outputs",
     "unknown field 'yaml'"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of json, regex, grammar, "
     "choice and json_object, got none"),
    ({"structured_outputs": {"regex": None, "json_object": False}}, "structured_outputs",
     "got none"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of json, regex, grammar, choice and json_object, got ['choice', 'regex']"),
    ({"structured_outputs": {"json_object": True, "regex": "a"}}, "structured_outputs",
     "got ['json_object', 'regex']"),
    # json_object is the only flag: anything but true (false is not given) is refused
    *(({"structured_outputs": {"json_object": flag}}, "structured_outputs",
       "structured_outputs.json_object must be true") for flag in ("true", 1, 0)),
    # a false of another field is a wrong type, not "not given"
    ({"structured_outputs": {"regex": False}}, "structured_outputs.regex",
     "structured_outputs.regex must be a string"),
    ({"structured_outputs": {"grammar": ['root ::= "a"']}}, "structured_outputs.grammar",
     "must be a string"),
    ({"guided_regex": 5}, "guided_regex", "guided_regex must be a string"),
    ({"guided_grammar": False}, "guided_grammar", "guided_grammar must be a string"),
    ({"structured_outputs": {"json": False}}, "structured_outputs.json",
     "structured_outputs.json must be a JSON Schema"),
    ({"structured_outputs": {"json": ["a"]}}, "structured_outputs.json", "JSON Schema"),
    ({"guided_json": 5}, "guided_json", "guided_json must be a JSON Schema"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice",
     "structured_outputs.choice must be an array of strings"),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be an array of strings"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "structured_outputs.choice must be a list of non-empty strings"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "non-empty strings"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "non-empty strings"),
    ({"guided_regex": "a" * (MAX_SOURCE_BYTES + 1)}, "guided_regex",
     f"at most {MAX_SOURCE_BYTES}"),
    ({"structured_outputs": {"grammar": "a" * (MAX_SOURCE_BYTES + 1)}},
     "structured_outputs.grammar", "at most"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "words"), MALFORMED_VLLM, ids=repr)
def test_a_malformed_vllm_field_is_refused_naming_it(body, param, words):
    error = refusal(body)
    assert error.param == param
    assert words in str(error)


STRICT_SCHEMAS = [
    # schemas that follow OpenAI's rules: the root an object, every object closed and
    # listing each of its properties in required (an optional field may be null)
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": ["string", "null"]},
        "b": {"type": "array", "items": {"type": "object", "properties": {"c": {"enum": [1]}},
                                         "required": ["c"], "additionalProperties": False}}}},
    {"type": "object", "additionalProperties": False, "required": ["item"],
     "properties": {"item": {"$ref": "#/$defs/Item"}},
     "$defs": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": False}}},
]  # fmt: skip


@pytest.mark.parametrize("schema", STRICT_SCHEMAS, ids=repr)
def test_a_strict_schema_that_follows_openais_rules_is_accepted(schema):
    output = parse_structured_output(json_schema(name="x", strict=True, schema=schema))
    assert (output.kind, output.field) == ("json_schema", "response_format.json_schema.schema")
    assert json.loads(output.source) == schema


OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}  # neither closed nor required


def closed(properties: dict, **extra) -> dict:
    """An object that follows the rules itself: closed, every property required."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False, **extra}  # fmt: skip


BROKEN_RULES = [
    # (schema, the rule and the JSON pointer of the object at fault)
    ({"type": "array", "items": closed({})}, "the root must be an object (type 'object')"),
    ({"properties": {}, "additionalProperties": False},
     "the root must be an object (type 'object')"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"]},
     "'additionalProperties' must be false at /"),
    ({"type": "object", "properties": {}, "additionalProperties": True},
     "'additionalProperties' must be false at /"),
    ({"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
     "'additionalProperties' must be false at /"),
    ({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["a"],
      "additionalProperties": False},
     "'required' at / must list every property; 'b' is missing"),
    (closed({"a": OPEN}), "'additionalProperties' must be false at /properties/a"),
    # an object by its properties alone, without a type
    (closed({"a": {"properties": {"b": {}}, "additionalProperties": False}}),
     "'required' at /properties/a must list every property; 'b' is missing"),
    (closed({"a": {"type": "array", "items": OPEN}}),
     "'additionalProperties' must be false at /properties/a/items"),
    (closed({"a": {"anyOf": [{"type": "null"}, OPEN]}}),
     "'additionalProperties' must be false at /properties/a/anyOf/1"),
    (closed({"a": {"$ref": "#/$defs/Item"}}, **{"$defs": {"Item": OPEN}}),
     "'additionalProperties' must be false at /$defs/Item"),
    (closed({"a": {"type": "array", "prefixItems": [{"type": "integer"}, OPEN]}}),
     "'additionalProperties' must be false at /properties/a/prefixItems/1"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "words"), BROKEN_RULES, ids=repr)
def test_a_strict_schema_that_breaks_openais_rules_is_refused_with_its_pointer(schema, words):
    error = refusal(json_schema(name="x", strict=True, schema=schema))
    field = "response_format.json_schema.schema"
    assert error.param == field
    assert str(error) == f"{field}: strict: {words}"


@pytest.mark.parametrize("strict", [{}, {"strict": None}, {"strict": False}])
@pytest.mark.parametrize("schema", [schema for schema, _ in BROKEN_RULES], ids=repr)
def test_openais_rules_hold_only_with_strict_true(schema, strict):
    output = parse_structured_output(json_schema(name="x", schema=schema, **strict))
    assert json.loads(output.source) == schema


# ---------------------------------------------------------------- through the HTTP API

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


def test_json_schema_without_a_schema_is_answered(client):
    # what it parses to: test_json_schema_without_a_schema_is_any_json_value
    for strict in (True, False):
        fields = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "any", "strict": strict},
            }
        }
        assert chat(client, **fields)["finish_reason"] in ("stop", "length")


def test_a_strict_schema_that_follows_openais_rules_is_answered(client):
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
