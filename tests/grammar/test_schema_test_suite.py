"""The JSON Schema Test Suite (draft 2020-12) through each grammar backend (MASK-SOUND-1).

The whole suite runs here (a few seconds a backend, no model): no invalid
instance of any schema a backend accepts may get through its matcher. What
each backend covers (valid instances accepted, schemas refused per keyword) is
measured by `make bench-structured`, not asserted: coverage is not promised.
"""

from __future__ import annotations

import functools
import re

import pytest

from decodespec.reference.gguf_file import open_gguf
from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.reference.model_files import bundled_model_path
from decodespec.reference.tokenizer import Tokenizer
from tests.grammar.schema_suite import layout_json, matcher_accepts, run_suite


@functools.cache
def bundled_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(open_gguf(bundled_model_path()))


@functools.cache
def grammars(backend: str) -> GrammarCompiler:
    tokenizer = bundled_tokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, backend)


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_invalid_instance_of_the_test_suite_gets_through(backend):
    result = run_suite(grammars(backend))
    assert sum(result.invalid.values()) > 200, "too few schemas accepted to mean anything"
    assert result.unsound == [], "\n".join(
        f"{case}: {description}: the matcher took {text}"
        for case, description, text in result.unsound
    )
    # The suite is also a completeness check of the oracle: most valid instances of the
    # accepted schemas get through (a matcher that admits nothing is sound too).
    assert sum(result.accepted.values()) > 0.6 * sum(result.valid.values())


# The issue's three examples: each backend refuses the schema naming the keyword, or
# enforces it (the instance that broke it is refused and a valid one taken).
ISSUE_EXAMPLES = [
    (
        {
            "type": "object",
            "properties": {"username": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}},
            "required": ["username"],
            "additionalProperties": False,
        },
        {"username": "johnnyjohns"},
        {"username": "johnny"},
    ),
    (
        {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email", "maxLength": 20}},
            "required": ["email"],
            "additionalProperties": False,
        },
        {"email": "jonathan.livingston.seagull@example.com"},
        {"email": "jo@example.com"},
    ),
    (
        {
            "type": "object",
            "properties": {"price": {"type": "number", "multipleOf": 0.25}},
            "required": ["price"],
            "additionalProperties": False,
        },
        {"price": 7.83},
        {"price": 7.75},
    ),
]
REFUSALS = {
    "xgrammar": ["'maxLength' at /properties/username", "'format' at /properties/email",
                 "'multipleOf' at /properties/price"],
}  # fmt: skip


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("example", range(len(ISSUE_EXAMPLES)))
def test_the_issue_examples_are_refused_naming_the_keyword_or_enforced(backend, example):
    schema, broken, valid = ISSUE_EXAMPLES[example]
    output = StructuredOutput.json_schema(schema, field="response_format")
    refusal = REFUSALS.get(backend, [None] * len(ISSUE_EXAMPLES))[example]
    if refusal is not None:
        with pytest.raises(GrammarError, match=f"^response_format: {refusal}"):
            grammars(backend).compile(output)
        return
    compiled = grammars(backend).compile(output)
    assert not matcher_accepts(grammars(backend), compiled, layout_json(broken, schema))
    assert matcher_accepts(grammars(backend), compiled, layout_json(valid, schema))


def test_layout_json_writes_the_schema_order_and_integral_numbers_as_integers():
    schema = {"properties": {"a": {"prefixItems": [{"properties": {"y": {}, "x": {}}}]}, "b": {}}}
    value = {"c": None, "b": 1.0, "a": [{"x": 0.5, "y": "é"}, 3.0]}
    assert layout_json(value, schema) == '{"a":[{"y":"é","x":0.5},3],"b":1,"c":null}'


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("schema", "message"),
    [
        # Draft 7's "definitions" is walked like "$defs" ...
        (
            {"type": "object", "properties": {"a": {"$ref": "#/definitions/n"}},
             "definitions": {"n": {"not": {"type": "string"}}}},
            "'not' at /definitions/n",
        ),
        # ... and a reference to a place the walk does not check is refused: its
        # keywords would reach the library unchecked (xgrammar dropped this maxLength).
        (
            {"other": {"x": {"type": "string", "maxLength": 3, "pattern": "^a"}},
             "$ref": "#/other/x"},
            "'$ref' at /: '#/other/x' points to no subschema",
        ),
    ],
)  # fmt: skip
def test_a_subschema_reached_by_a_reference_is_checked(backend, schema, message):
    with pytest.raises(GrammarError, match=f"^t: {re.escape(message)}"):
        grammars(backend).compile(StructuredOutput.json_schema(schema, field="t"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_object_that_lists_its_properties_admits_only_those(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    compiled = grammars(backend).compile(StructuredOutput.json_schema(schema, field="t"))
    assert matcher_accepts(grammars(backend), compiled, '{"a":1}')
    assert not matcher_accepts(grammars(backend), compiled, '{"a":1,"b":2}')


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_length_bounded_string_is_json(backend):
    # xgrammar's bounded strings took a raw tab (found by test_soundness's walks).
    output = StructuredOutput.json_schema({"type": "string", "maxLength": 3}, field="t")
    if backend == "xgrammar":
        with pytest.raises(GrammarError, match=r"^t: 'maxLength' at /: xgrammar's length-bounded"):
            grammars(backend).compile(output)
        return
    compiled = grammars(backend).compile(output)
    assert matcher_accepts(grammars(backend), compiled, '"a b"')
    assert not matcher_accepts(grammars(backend), compiled, '"a\tb"')
