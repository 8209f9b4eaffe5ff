"""The schema policy refuses a keyword wherever it sits (issue 38, item 8).

`enforceable_schema` walks every place a subschema can sit: a keyword refused at
the root is refused under `properties`, `items`, `anyOf`, and under `$defs` and
draft 7's `definitions`, referenced or not, and the refusal names its place. A
walk that skipped one of them would hand its keywords to the library unchecked.
"""

from __future__ import annotations

import pytest

from decodespec.reference.grammar import GrammarCompiler, StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.reference.schema_policy import NEVER, REFUSED, SchemaRefused, enforceable_schema

# A valid value of each refused keyword.
VALUES = {
    "not": {"type": "string"},
    "if": {"type": "string"},
    "then": {"type": "string"},
    "else": {"type": "string"},
    "uniqueItems": True,
    "contains": {"type": "string"},
    "minContains": 1,
    "maxContains": 2,
    "dependentSchemas": {"a": {"required": ["b"]}},
    "dependentRequired": {"a": ["b"]},
    "$dynamicRef": "#node",
    "$dynamicAnchor": "node",
    "unevaluatedItems": False,
    "unevaluatedProperties": False,
    "oneOf": [{"type": "string"}, {"type": "integer"}],
    "allOf": [{"type": "string"}],
    "propertyNames": {"maxLength": 3},
    "patternProperties": {"^a": {"type": "string"}},
}


def placements(refused: dict) -> list[tuple[str, dict, str]]:
    """(name, schema with `refused` placed somewhere, the JSON pointer of that place)."""
    return [
        ("root", refused, "/"),
        ("properties", {"type": "object", "properties": {"x": refused}}, "/properties/x"),
        ("items", {"type": "array", "items": refused}, "/items"),
        ("anyOf", {"anyOf": [{"type": "null"}, refused]}, "/anyOf/1"),
        ("$defs", {"$ref": "#/$defs/x", "$defs": {"x": refused}}, "/$defs/x"),
        ("definitions", {"$ref": "#/definitions/x", "definitions": {"x": refused}},
         "/definitions/x"),
        ("unreferenced $defs", {"type": "string", "$defs": {"x": refused}}, "/$defs/x"),
        ("unreferenced definitions", {"type": "string", "definitions": {"x": refused}},
         "/definitions/x"),
        ("definitions under $defs",
         {"$ref": "#/$defs/a",
          "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/definitions/c"}}}},
          "definitions": {"c": refused}},
         "/definitions/c"),
    ]  # fmt: skip


CASES = [
    pytest.param(backend, keyword, schema, pointer, id=f"{backend}-{keyword}-{place}")
    for backend in BACKENDS
    for keyword in sorted(NEVER | REFUSED[backend])
    for place, schema, pointer in placements({keyword: VALUES[keyword]})
]


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize(("backend", "keyword", "schema", "pointer"), CASES)
def test_a_refused_keyword_is_refused_wherever_it_sits(backend, keyword, schema, pointer):
    with pytest.raises(SchemaRefused) as refusal:
        enforceable_schema(schema, backend)
    assert str(refusal.value).startswith(f"'{keyword}' at {pointer}"), (
        f"enforceable_schema({schema!r}, {backend!r}) refused with {str(refusal.value)!r}, "
        f"not naming '{keyword}' at {pointer}"
    )


def test_every_refused_keyword_has_a_value_here():
    assert set(VALUES) >= NEVER | REFUSED["llguidance"] | REFUSED["xgrammar"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("maps", ["$defs", "definitions"])
def test_an_enforceable_definition_passes(backend, maps):
    schema = {"$ref": f"#/{maps}/x", maps: {"x": {"type": "string", "pattern": "^a+$"}}}
    enforceable_schema(schema, backend)  # no refusal


# (schema, an integer it admits, one it rejects): at xgrammar's limits on `multipleOf`.
MULTIPLE_OF_KEPT = [
    ({"type": "integer", "multipleOf": 2}, 8, 7),
    ({"type": "integer", "multipleOf": 1024}, 2048, 1025),
    ({"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 9999}, 8, 7),
    ({"type": "integer", "multipleOf": 2, "exclusiveMinimum": -1, "exclusiveMaximum": 9998}, 8, 7),
]
MULTIPLE_OF_DROPPED = [
    {"type": "integer", "multipleOf": 2, "minimum": 0},
    {"type": "integer", "multipleOf": 2, "exclusiveMaximum": 60},
    {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 10000},
    {"type": "integer", "multipleOf": 1025},
]


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize(("schema", "valid", "invalid"), MULTIPLE_OF_KEPT)
def test_xgrammar_enforces_every_multiple_of_the_policy_lets_through(schema, valid, invalid):
    from tests.engine.toy import ByteTokenizer
    from tests.grammar.schema_suite import matcher_accepts

    grammars = GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, "xgrammar")
    compiled = grammars.compile(StructuredOutput.json_schema(schema, field="schema"))
    assert matcher_accepts(grammars, compiled, str(valid))
    assert not matcher_accepts(grammars, compiled, str(invalid)), f"{invalid} under {schema}"


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("schema", MULTIPLE_OF_DROPPED)
def test_a_multiple_of_xgrammar_would_drop_is_refused(schema):
    # Past these limits xgrammar drops `multipleOf` with a warning on stderr: the random
    # walks of test_soundness.py found 7 under {"minimum": 0, "multipleOf": 2}.
    with pytest.raises(SchemaRefused, match=r"^'multipleOf' at /: "):
        enforceable_schema(schema, "xgrammar")
