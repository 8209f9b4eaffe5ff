"""The JSON layout of both grammar backends (MASK-JSON-1): whitespace wherever JSON allows
it, at most `MAX_JSON_WHITESPACE` characters in one place."""

from __future__ import annotations

import pytest

from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS, MAX_JSON_WHITESPACE
from tests.grammar.schema_suite import matcher_accepts
from tests.grammar.test_schema_test_suite import grammars

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
    "required": ["a"],
}


@pytest.mark.clause("MASK-JSON-1")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
@pytest.mark.parametrize("space", [" ", "\n", "\t", "\r\n"])
def test_json_takes_a_bounded_run_of_whitespace_in_each_place(backend, kind, space):
    output = (
        StructuredOutput.json_schema(SCHEMA, field="t")
        if kind == "json_schema"
        else StructuredOutput("json_object", field="t")
    )
    compiled = grammars(backend).compile(output)

    def takes(gap: str) -> bool:
        text = f'{{{gap}"a"{gap}:{gap}[{gap}1{gap},{gap}2{gap}]{gap}}}'
        return matcher_accepts(grammars(backend), compiled, text)

    most = space * (MAX_JSON_WHITESPACE // len(space))
    too_many = most + " " * (MAX_JSON_WHITESPACE - len(most) + 1)  # one character more
    assert takes("") and takes(most)
    assert not takes(too_many)
    # Not inside a token of JSON's own: a number or a key is written whole.
    assert not matcher_accepts(grammars(backend), compiled, '{"a": [1 2]}')
