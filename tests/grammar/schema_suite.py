"""The JSON Schema Test Suite (draft 2020-12) run through the grammar stage, no model.

For every case (a schema and instances marked valid or invalid) and a grammar
backend: the schema is checked as a request's would be (`GrammarCompiler.compile`);
a refused schema is counted under the keyword its error names. For an accepted
one, each instance is written in the grammar's layout (`layout_json`: the
schema's property order, compact) and fed to a fresh matcher
token by token, then the stop token:
- an *invalid* instance the matcher takes whole is a soundness failure
  (MASK-SOUND-1: must never happen);
- a *valid* instance it refuses is a completeness miss, counted per keyword
  (a grammar may admit less than its schema: a fixed key order, a bounded
  whitespace, integers written without a fraction).

`tests/grammar/test_schema_test_suite.py` runs a fast subset in `make test`;
`make bench-structured` runs it whole for each backend (`run_suite`).
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput

SUITE = Path(__file__).parent / "data" / "json-schema-test-suite"
# Keywords that only annotate (never change validity): not worth a column of their own.
ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "title", "description", "default", "examples", "$anchor"}
)


@dataclass(frozen=True)
class Case:
    """One schema of the suite with its instances: (description, data, valid)."""

    group: str  # the file, e.g. "maxLength" or "format/email"
    description: str
    schema: Any
    instances: tuple[tuple[str, Any, bool], ...]

    @property
    def id(self) -> str:
        return f"{self.group}: {self.description}"


def cases(groups: set[str] | None = None) -> Iterator[Case]:
    """The suite's cases, file by file (`groups`: only those files)."""
    for path in sorted(SUITE.rglob("*.json")):
        group = path.relative_to(SUITE).with_suffix("").as_posix()
        if groups is not None and group not in groups:
            continue
        for entry in json.loads(path.read_text()):
            yield Case(
                group,
                entry["description"],
                entry["schema"],
                tuple((t["description"], t["data"], t["valid"]) for t in entry["tests"]),
            )


def layout_json(value: Any, schema: Any = None) -> str:
    """`value` as JSON text in the grammar's layout: properties in the order the schema
    lists them (others after, as they come), no whitespace (any `MAX_JSON_WHITESPACE`
    takes that), integral floats without a fraction (1.0 is the integer 1 under JSON Schema)."""
    if isinstance(value, dict):
        order = schema.get("properties", {}) if isinstance(schema, dict) else {}
        keys = [k for k in order if k in value] + [k for k in value if k not in order]
        parts = [
            f"{json.dumps(k, ensure_ascii=False)}:{layout_json(value[k], order.get(k))}"
            for k in keys
        ]
        return "{" + ",".join(parts) + "}"
    if isinstance(value, list):
        items = schema.get("items") if isinstance(schema, dict) else None
        prefix = schema.get("prefixItems", []) if isinstance(schema, dict) else []
        return (
            "["
            + ",".join(
                layout_json(v, prefix[i] if i < len(prefix) else items) for i, v in enumerate(value)
            )
            + "]"
        )
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False)


def matcher_accepts(grammars: GrammarCompiler, compiled: Any, text: str) -> bool:
    """Whether a fresh matcher of `compiled` takes `text` (any tokenization of it: the
    tokenizer's) and then a stop token."""
    matcher = grammars.backend.matcher(compiled)
    tokenizer = grammars.tokenizer
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(tokenizer.eos_token_ids[0])


# The libraries' own refusals, which name no keyword in quotes first, and what they refuse.
_LIBRARY_REFUSALS = (
    (re.compile(r'Unimplemented keys: \["([^"]+)"'), None),  # llguidance: the keyword
    (re.compile(r"^Unknown format\b"), "format"),
    (re.compile(r"^(\w+) constraints are not supported"), None),
    (re.compile(r"^patternProperty regexes\b"), "patternProperties"),
    (
        re.compile(r"Unsatisfiable schema|Schema 'false' cannot|must not be empty"),
        "(unsatisfiable)",
    ),
    (re.compile(r"^Expecting object schema"), "(boolean schema)"),
    (re.compile(r"^Cannot find field .* in #"), "$ref"),
    (re.compile(r"is not present in a registry"), "(remote resource)"),
    (re.compile(r"^regex parse error|^Regex parsing error"), "pattern"),
    (re.compile(r"^Check failed"), "(library error)"),  # xgrammar's internal assertion
)
_NOT_A_SCHEMA = re.compile(r"^not a valid JSON Schema at (\S*): ")
_LEADING_KEYWORD = re.compile(r"^(\$?[a-zA-Z]+) (must|is|should|cannot)\b")


def refused_keyword(message: str) -> str:
    """The keyword a refusal names: schema_policy's messages quote it first ("'maxLength'
    at /"); the libraries' own name it in their words (`Unimplemented keys:
    ["propertyNames"]`, `Unknown format: iri`, `oneOf constraints are not supported`,
    `maxItems must be ...`); a schema that admits nothing is "(unsatisfiable)", one the
    JSON Schema meta-schema refuses is named by the keyword at its place."""
    if ": " in message and message.split(": ", 1)[0].isidentifier():
        message = message.split(": ", 1)[1]  # the request field GrammarCompiler names
    for pattern, keyword in _LIBRARY_REFUSALS:
        found = pattern.search(message)
        if found:
            return keyword or found.group(1)
    found = _NOT_A_SCHEMA.match(message)
    if found:
        words = [w for w in found.group(1).split("/") if w and not w.isdigit()]
        return words[-1] if words else "(not a schema)"
    start = message.find("'")
    end = message.find("'", start + 1)
    if 0 <= start < end:
        return message[start + 1 : end]
    found = _LEADING_KEYWORD.match(message)
    return found.group(1) if found else "other"


@dataclass
class SuiteResult:
    """Counts per group (the suite's file: a keyword, or format/NAME)."""

    backend: str
    cases: Counter = field(default_factory=Counter)
    refused: Counter = field(default_factory=Counter)  # group -> schemas refused
    refused_by_keyword: Counter = field(default_factory=Counter)
    invalid: Counter = field(default_factory=Counter)  # group -> invalid instances run
    unsound: list = field(default_factory=list)  # (case id, instance description, text)
    valid: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)  # valid instances accepted
    misses: list = field(default_factory=list)  # (case id, instance description, text)


def run_suite(grammars: GrammarCompiler, groups: set[str] | None = None) -> SuiteResult:
    result = SuiteResult(grammars.backend.name)
    for case in cases(groups):
        result.cases[case.group] += 1
        output = StructuredOutput.json_schema(case.schema, field="schema")
        try:
            compiled = grammars.compile(output)
        except GrammarError as error:
            result.refused[case.group] += 1
            result.refused_by_keyword[refused_keyword(str(error))] += 1
            continue
        for description, data, valid in case.instances:
            text = layout_json(data, case.schema)
            accepted = matcher_accepts(grammars, compiled, text)
            if valid:
                result.valid[case.group] += 1
                result.accepted[case.group] += accepted
                if not accepted:
                    result.misses.append((case.id, description, text))
            else:
                result.invalid[case.group] += 1
                if accepted:
                    result.unsound.append((case.id, description, text))
    return result
