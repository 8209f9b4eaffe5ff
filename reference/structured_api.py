"""The structured-output fields of an OpenAI request body, as a `StructuredOutput`.

OpenAI's `response_format`:
- `{"type": "text"}`: unconstrained (the default);
- `{"type": "json_object"}`: any JSON object;
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`: JSON that fits `schema` (the official client's
  `chat.completions.parse(response_format=PydanticModel)` sends this);
  without `schema`, any JSON value. With `strict: true`, OpenAI's rules hold
  (`check_strict`: the root an object, every object closed with
  `additionalProperties: false` and all its properties required), as OpenAI
  refuses such a schema with a 400 too.

vLLM's extra body field `structured_outputs`, one of `{"json": schema}`,
`{"regex": str}`, `{"grammar": EBNF}`, `{"choice": [str, ...]}` or
`{"json_object": true}`, and its older top-level spellings `guided_json`,
`guided_regex`, `guided_grammar` and `guided_choice`.

A request gives at most one of them. A field set to null is not given (the
request parser drops top-level nulls; here, nulls inside `structured_outputs`
and a null `json_schema.schema`), nor is `"json_object": false` in
`structured_outputs`, nor `response_format` `{"type": "text"}`, which asks
for no constraint: `{"regex": "a+", "json_object": false}` is a regex, as
vLLM's and OpenAI's clients may send it. Every error is a `GrammarError` whose
`.param` names the field at fault; the grammar itself is compiled, and its
errors raised, by the engine when the request is added (`GrammarCompiler.compile`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from .grammar import GrammarError, StructuredOutput

# vLLM's spellings: structured_outputs key (and guided_<key>) -> our kind.
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}
FIELDS = ("response_format", "structured_outputs", *(f"guided_{k}" for k in VLLM_KINDS))


def parse_structured_output(body: Mapping[str, object]) -> StructuredOutput | None:
    """The request's structured output, None when it has none.

    Example:
        >>> parse_structured_output({"response_format": {"type": "json_object"}}).kind
        'json_object'
        >>> parse_structured_output({"structured_outputs": {"choice": ["yes", "no"]}}).choices
        ('yes', 'no')
    """
    given = [name for name in FIELDS if name in body and not _unconstrained(name, body[name])]
    if len(given) > 1:
        raise GrammarError(given[1], f"give one of {' and '.join(given)}, not both")
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _vllm(VLLM_KINDS[name.removeprefix("guided_")], value, name)


def _unconstrained(name: str, value: object) -> bool:
    """A field that asks for no structured output: null, or `response_format` text."""
    if value is None:
        return True
    return name == "response_format" and isinstance(value, dict) and value.get("type") == "text"


def _response_format(value: object) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise GrammarError("response_format", "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", field="response_format")
    if kind != "json_schema":
        raise GrammarError(
            "response_format",
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError("response_format", "response_format.json_schema must be an object")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise GrammarError("response_format", "response_format.json_schema.name is required")
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise GrammarError(
            "response_format", "response_format.json_schema.strict must be a boolean"
        )
    field = "response_format.json_schema.schema"
    if spec.get("schema") is None:
        # OpenAI's schema is optional: without one (or null), the answer is any JSON value (the
        # empty schema), strict or not.
        return StructuredOutput.json_schema({}, field=field)
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise GrammarError("response_format", f"{field} must be an object")
    if spec.get("strict"):
        check_strict(schema, field)
    return StructuredOutput.json_schema(schema, field=field)


def check_strict(schema: dict, field: str) -> None:
    """OpenAI's rules for `strict: true`: the root is an object, and every object in the
    schema sets `additionalProperties: false` and lists each of its properties in
    `required` (an optional field is a required one that may be null).

    Raises:
        GrammarError: naming `field`, the rule and its JSON pointer.
    """
    if schema.get("type") != "object":
        raise GrammarError(field, f"{field}: strict: the root must be an object (type 'object')")
    for where, node in _subschemas(schema, ""):
        if node.get("type") != "object" and "properties" not in node:
            continue
        if node.get("additionalProperties") is not False:
            raise GrammarError(
                field, f"{field}: strict: 'additionalProperties' must be false at {where or '/'}"
            )
        missing = [
            name for name in node.get("properties", {}) if name not in node.get("required", [])
        ]
        if missing:
            raise GrammarError(
                field, f"{field}: strict: 'required' at {where or '/'} must list every "
                f"property; {missing[0]!r} is missing",
            )  # fmt: skip


def _subschemas(schema: object, where: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in `schema` with its JSON pointer, `schema` first."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(
            value, dict
        ):
            for name, item in value.items():
                yield from _subschemas(item, f"{where}/{key}/{name}")
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{where}/{key}/{i}")
        elif key in ("items", "additionalProperties", "not", "contains"):
            yield from _subschemas(value, f"{where}/{key}")


def _structured_outputs(value: object) -> StructuredOutput:
    if not isinstance(value, dict):
        raise GrammarError("structured_outputs", "structured_outputs must be an object")
    # null is not given, and so is json_object false (the only flag); another field's false
    # is a wrong type, refused below naming it.
    given = {
        k: v for k, v in value.items() if v is not None and not (k == "json_object" and v is False)
    }
    unknown = sorted(set(given) - {*VLLM_KINDS, "json_object"})
    if unknown:
        raise GrammarError(
            "structured_outputs", f"structured_outputs has an unknown field {unknown[0]!r}"
        )
    if len(given) != 1:
        raise GrammarError(
            "structured_outputs",
            "structured_outputs must hold exactly one of json, regex, grammar, choice "
            f"and json_object, got {sorted(given) or 'none'}",
        )
    ((key, item),) = given.items()
    if key == "json_object":
        if item is not True:
            raise GrammarError("structured_outputs", "structured_outputs.json_object must be true")
        return StructuredOutput("json_object", field="structured_outputs.json_object")
    return _vllm(VLLM_KINDS[key], item, f"structured_outputs.{key}")


def _vllm(kind: str, value: object, field: str) -> StructuredOutput:
    if kind == "json_schema":
        if not isinstance(value, dict | str):
            raise GrammarError(field, f"{field} must be a JSON Schema (an object or its text)")
        return StructuredOutput.json_schema(value, field=field)
    if kind == "choice":
        if not isinstance(value, list):
            raise GrammarError(field, f"{field} must be an array of strings")
        return StructuredOutput("choice", choices=tuple(value), field=field)
    if not isinstance(value, str):
        raise GrammarError(field, f"{field} must be a string")
    return StructuredOutput(kind, source=value, field=field)  # type: ignore[arg-type]
