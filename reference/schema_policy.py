"""Which JSON Schema keywords each grammar library enforces whole (MASK-SOUND-1).

A grammar library that meets a keyword it cannot express either refuses the
schema or, worse, drops the keyword with a warning on stderr and lets through
output the schema rejects (xgrammar: `maxLength` beside `pattern`, `multipleOf`
on numbers, overlapping `oneOf` branches read as `anyOf`). This module decides
before the library sees the schema: every keyword of every subschema must be
one the chosen backend enforces in that place, or the schema is refused with
the keyword and its JSON pointer (`'maxLength' with 'pattern' at
/properties/username`).

The lists were derived from the JSON Schema Test Suite (draft 2020-12) run
through each backend (tests/grammar/schema_suite.py): a keyword stays allowed
only where no invalid instance of the suite gets through, and the soundness
property test (tests/grammar/test_soundness.py) walks random token paths of
accepted schemas and validates every completed string.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# Keywords that never change whether an instance is valid (annotations, identifiers).
ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "$comment",
        "$anchor",
        "$vocabulary",
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
    }
)
# Keywords whose value is a schema, a list of schemas or a mapping of names to schemas.
SUBSCHEMA = (
    "items",
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
)
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# ("definitions" is draft 7's "$defs", which real-world schemas still use.)
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Keywords a context-free grammar cannot enforce ("not this", "all different", "if
# this then that") or that neither library implements.
NEVER = frozenset(
    {
        "not",
        "if",
        "then",
        "else",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "dependentSchemas",
        "dependentRequired",
        "$dynamicRef",
        "$dynamicAnchor",
        "unevaluatedItems",
    }
)
# What each library leaves out, found by the Test Suite (module docstring):
# - llguidance refuses by itself what it does not implement, but without saying where;
#   these are refused here first, with their place;
# - xgrammar drops `allOf`, reads `oneOf` as `anyOf`, ignores a type's keywords in a
#   schema without "type", drops the length bounds beside a `pattern` or a `format`, and
#   its length-bounded strings take raw control characters. Found by the soundness tests
#   instead: it drops an integer `multipleOf` beside a bound on one side, a pattern's `X?`
#   can spell a part of X, and a lookahead is ignored (`_xgrammar_pattern` rewrites the
#   one and refuses the other).
REFUSED = {
    "llguidance": frozenset({"oneOf", "propertyNames"}),
    "xgrammar": frozenset(
        {"allOf", "oneOf", "propertyNames", "patternProperties", "unevaluatedProperties"}
    ),
}
# The formats each library enforces soundly by itself (its own patterns admit only
# strings the Test Suite calls valid).
NATIVE_FORMATS = {
    "llguidance": frozenset({"email", "ipv4", "ipv6", "uuid", "uri", "duration"}),
    "xgrammar": frozenset(),
}
# Formats both libraries let through invalid strings of (February 29th of 2021, a leap
# second at 22:59): given to the library as these patterns instead, which admit a
# subset of RFC 3339's strings (no leap seconds, upper-case T and Z) and only valid ones.
_YEAR = "([0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # not 0000
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (
    f"({_YEAR}-(0[1-9]|1[0-2])-(0[1-9]|1[0-9]|2[0-8])"
    f"|{_YEAR}-(0[13-9]|1[0-2])-(29|30)"
    f"|{_YEAR}-(0[13578]|1[02])-31"
    f"|{_LEAP_YEAR}-02-29)"
)
_TIME = (
    "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}

# The keywords that constrain one JSON type only (they pass any value of another type).
TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset(
        {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
    ),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset(
        {"properties", "required", "additionalProperties", "minProperties", "maxProperties"}
    ),
}


class SchemaRefused(ValueError):
    """A schema the backend would enforce only in part; the message names the keyword
    (quoted first) and its place."""


def enforceable_schema(schema: object, backend: str) -> object:
    """The schema to give `backend`: `schema` itself, or with each `format` of
    FORMAT_PATTERNS as its pattern and, for xgrammar, the "type" that a schema without
    one implies (only a type's keywords; admitting less is sound) and each pattern's
    `?` written `{0,1}` (`_xgrammar_pattern`: the same language). Raises
    `SchemaRefused` for the first keyword `backend` would not enforce whole.

    Example:
        >>> enforceable_schema({"type": "array", "uniqueItems": True}, "xgrammar")
        Traceback (most recent call last):
        ...
        decodespec.reference.schema_policy.SchemaRefused: 'uniqueItems' at /: ...
    """
    walked: set[str] = set()
    refs: list[tuple[str, str]] = []
    out = _walk(schema, backend, "", walked, refs)
    for where, ref in refs:
        if unquote(ref[1:]) not in walked:
            # A subschema the walk did not check (under an unknown keyword): refused, or a
            # library would compile keywords this module never saw.
            raise _refuse("$ref", where, f"{ref!r} points to no subschema of a known keyword")
    return out


def _refuse(keyword: str, where: str, why: str) -> SchemaRefused:
    return SchemaRefused(f"{keyword!r} at {where or '/'}: {why}")


def _walk(
    schema: object, backend: str, where: str, walked: set[str], refs: list[tuple[str, str]]
) -> object:
    """`schema` as the library gets it; records the pointers it checked in `walked` and
    each `$ref` with its place in `refs`."""
    walked.add(where)
    if not isinstance(schema, dict):
        return schema
    for keyword in schema:
        if keyword in NEVER:
            raise _refuse(keyword, where, "a grammar cannot enforce it")
        if keyword in REFUSED[backend]:
            raise _refuse(keyword, where, f"{backend} does not enforce it")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise _refuse("$ref", where, f"{ref!r}: only JSON pointers inside the schema (#/...)")
    if isinstance(ref, str):
        refs.append((where, ref))
    if where and "$id" in schema:
        raise _refuse("$id", where, "a nested resource changes what '#/...' points to")
    out = dict(schema)
    _close(out)
    if "format" in schema:
        _format(out, backend, where)
    if backend == "xgrammar":
        _xgrammar_node(out, where)
    for key in SUBSCHEMA:
        if key in out:
            out[key] = _walk(out[key], backend, f"{where}/{key}", walked, refs)
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [
                _walk(v, backend, f"{where}/{key}/{i}", walked, refs)
                for i, v in enumerate(out[key])
            ]
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {
                name: _walk(v, backend, f"{where}/{key}/{_escape(name)}", walked, refs)
                for name, v in out[key].items()
            }
    return out


def _close(node: dict) -> None:
    """An object schema that lists its properties and says nothing of others admits
    only those (MASK-JSON-1), as xgrammar (vLLM's default) and OpenAI's strict mode do:
    a subset of what the schema allows, so sound. Measured on JSONSchemaBench: open
    objects let the bundled model write keys the schema never named ("type",
    "properties") and loop until max_tokens."""
    if "properties" in node and not node.keys() & {
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    }:
        node["additionalProperties"] = False


def _format(node: dict, backend: str, where: str) -> None:
    name = node["format"]
    if name in FORMAT_PATTERNS:
        if "pattern" in node:
            raise _refuse("format", where, f"{name!r} with 'pattern': {backend} enforces one")
        node["pattern"] = FORMAT_PATTERNS[name]
        del node["format"]
    elif name not in NATIVE_FORMATS[backend]:
        raise _refuse("format", where, f"{name!r}: {backend} does not enforce this format")


def _xgrammar_node(node: dict, where: str) -> None:
    """xgrammar's gaps inside one schema: an implied type made explicit, a pattern
    written as it enforces it, and the combinations it drops refused."""
    if "type" not in node:
        implied = [t for t, keywords in TYPE_KEYWORDS.items() if keywords & node.keys()]
        if len(implied) > 1:
            keyword = sorted(TYPE_KEYWORDS[implied[1]] & node.keys())[0]
            raise _refuse(keyword, where, "xgrammar needs a 'type' beside keywords of two types")
        if implied:
            node["type"] = implied[0]
    if isinstance(node.get("pattern"), str):
        node["pattern"] = _xgrammar_pattern(node["pattern"], where)
    for bound in ("minLength", "maxLength"):
        if bound in node and "pattern" in node:
            raise _refuse(bound, where, "with 'pattern' (or a date/time format): xgrammar drops it")
        if bound in node:
            # Its bounded strings take raw control characters (a tab), which JSON refuses.
            raise _refuse(bound, where, "xgrammar's length-bounded strings are not always JSON")
    if "multipleOf" in node:
        _xgrammar_multiple_of(node, where)
    missing = [name for name in node.get("required", ()) if name not in node.get("properties", {})]
    if missing:
        raise _refuse(
            "required", where, f"{missing[0]!r} is not in 'properties': xgrammar drops it"
        )


# The integer `multipleOf` xgrammar enforces: up to this, beside no bound or a range of at
# most this many integers; elsewhere it drops the keyword with a warning on stderr
# (cpp/json_schema_converter.cc; the random walks found `7` under minimum 0, multipleOf 2).
XGRAMMAR_MULTIPLE_OF_MAX = 1024
XGRAMMAR_MULTIPLE_OF_RANGE_MAX = 10000


def _xgrammar_multiple_of(node: dict, where: str) -> None:
    """Refuses a `multipleOf` that xgrammar would drop."""
    multiple = node["multipleOf"]
    if node.get("type") != "integer" or not isinstance(multiple, int):
        raise _refuse("multipleOf", where, "xgrammar enforces integer ones on integers only")
    if multiple > XGRAMMAR_MULTIPLE_OF_MAX:
        raise _refuse("multipleOf", where, f"over {XGRAMMAR_MULTIPLE_OF_MAX}: xgrammar drops it")
    lows = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
    highs = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
    # Bounds a <= b with b - a < N hold at most N integers, fractional ones too.
    if (lows or highs) and not (
        lows and highs and min(highs) - max(lows) < XGRAMMAR_MULTIPLE_OF_RANGE_MAX
    ):
        raise _refuse(
            "multipleOf",
            where,
            "with a bound on one side only, or over "
            f"{XGRAMMAR_MULTIPLE_OF_RANGE_MAX} integers between its bounds: xgrammar drops it",
        )


# A bounded repeat (`{2}`, `{1,}`, `{1,9}`); a `{` that starts none is a literal brace.
_REPEAT = re.compile(r"\{[0-9]+(,[0-9]*)?\}")


def _xgrammar_pattern(pattern: str, where: str) -> str:
    """`pattern` as xgrammar enforces it: each `?` quantifier written `{0,1}`, and a
    lookahead refused.

    xgrammar compiles a schema's pattern into an automaton (not through the regex
    converter that its `compile_regex` uses), where `X?` is X's automaton plus an
    empty move from X's start state to one of its end states
    (`FSMWithStartEnd::Optional`, cpp/fsm.cc). Where X loops back into its start
    or on from that end state, a path may loop and then take the move, spelling
    what X does not: `(a+b)?` admits "a", `(ab+)?` admits "b", and `time`'s
    `(\\.[0-9]{1,9})?` admitted a fraction without its dot
    ("22:14:2890986486Z", issue 64). Its `{0,1}` adds a fresh start state
    instead, which admits X or nothing. A lookahead it ignores, with a warning
    on stderr.

    The scan reads ECMA-262: `\\` escapes the next character, a class runs from
    `[` to the first unescaped `]`, and a `?` after `(` or after a quantifier is a
    group modifier or makes it lazy (the same language), so it stays."""
    out: list[str] = []
    in_class = False
    quantifiable = False  # the last thing written is an atom a quantifier may follow
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append(pattern[i : i + 2])
            quantifiable = not in_class
            i += 2
            continue
        if in_class:
            in_class = char != "]"
            quantifiable = not in_class
        elif char == "[":
            in_class = True
        elif char == "(" and pattern.startswith(("(?=", "(?!"), i):
            raise _refuse("pattern", where, f"{pattern!r}: xgrammar ignores a lookahead")
        elif char == "?" and quantifiable:
            char, quantifiable = "{0,1}", False
        elif char == "{" and (repeat := _REPEAT.match(pattern, i)):
            char, quantifiable = repeat.group(), False
            i = repeat.end() - 1
        else:
            quantifiable = char not in "(|^$*+?"
        out.append(char)
        i += 1
    return "".join(out)


def _escape(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
