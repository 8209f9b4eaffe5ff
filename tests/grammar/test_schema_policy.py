"""The schema policy refuses a keyword wherever it sits (issue 38, item 8).

`enforceable_schema` walks every place a subschema can sit: a keyword refused at
the root is refused under `properties`, `items`, `anyOf`, and under `$defs` and
draft 7's `definitions`, referenced or not, and the refusal names its place. A
walk that skipped one of them would hand its keywords to the library unchecked.
"""

from __future__ import annotations

import pytest

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
