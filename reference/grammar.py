"""Structured outputs: a request's grammar, compiled by xgrammar, as the spec's matcher.

A request may ask for output that matches a JSON Schema, any JSON object, a
regular expression, an EBNF grammar or one of a list of strings
(`StructuredOutput`). `Grammars` compiles it once, before the request is
queued, into xgrammar's automaton over this model's vocabulary; each request
then gets its own `GrammarMatcher`, which fills the row's token bitmask
every step and advances with every emitted token (the spec's `TokenMatcher`,
MASK-MATCHER-1). What the bitmask does to the logits is the spec's
`token_mask` stage, applied inside `sample` (MASK-SAMPLE-1).

Why xgrammar (`make bench-structured`, docs/structured.md): on this model
(49,152 tokens, one thread) it and llguidance fill masks about equally fast;
xgrammar builds its vocabulary tables faster, and llguidance compiles a
schema far faster (under a millisecond against tens, hundreds with
`maxLength`: a cost paid once per new schema). Both roll back, which
speculative drafts need. xgrammar's EBNF is llama.cpp's GBNF, so grammars
written for llama.cpp work as they are, and it is vLLM's default backend.

Bad input is a `GrammarError` (a `ParameterError` naming the request field
it came from) raised by `compile`, before any model work: a schema that is
not JSON, not valid under the JSON Schema meta-schema, or uses a keyword no
grammar can enforce (`not`, `if`, `uniqueItems`, ..., which xgrammar would
silently ignore) or a reference outside itself, a regular expression or
grammar that does not parse, a grammar that admits no string, a source
longer than `MAX_SOURCE_BYTES`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from decodespec.spec.checks import ParameterError
from decodespec.spec.token_mask import bitmask_words

if TYPE_CHECKING:
    import xgrammar

    from .tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")

# The largest schema, expression or grammar a request may send: compiling is linear-ish
# in its size, and it runs before the request is queued, on the server's engine thread.
MAX_SOURCE_BYTES = 64 * 1024
MAX_CHOICES = 256
# JSON's layout: any whitespace between tokens, as JSON allows and as models write it
# (a newline and an indent after "{"), but at most this much in one place, so that a
# model cannot spend its max_tokens on spaces. Compact-only JSON (no whitespace) drives
# a small model off what it learned: SmolLM2-135M wrote `{", ": 1174…` under it.
JSON_FORMAT = {"any_whitespace": True, "max_whitespace_cnt": 24}

# xgrammar's C++ errors start with a time stamp and a source location:
# "[11:38:31] /project/cpp/regex_converter.cc:83: Regex parsing error ...".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


# JSON Schema keywords a grammar cannot enforce (a context-free grammar cannot say "not
# this", "all different" or "if this then that"): xgrammar would ignore them silently and
# let through output the schema refuses, so a schema that uses them is refused instead.
UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "uniqueItems",
    "contains",
    "dependentSchemas",
    "dependencies",
    "$dynamicRef",
)
# Keywords whose value is a schema, a list of schemas or a mapping of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


class GrammarError(ParameterError):
    """A structured-output request that cannot be compiled; `.param` is its field."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    Attributes:
        kind: "json_schema" (`source` is the schema as JSON text), "json_object"
            (any JSON object; no source), "regex", "grammar" (EBNF, xgrammar's
            GBNF-compatible dialect, rule `root`) or "choice" (`choices`).
        source: the schema, expression or grammar text.
        choices: the strings of a "choice", at least one.
        field: the request field it came from, for error messages
            ("response_format", "structured_outputs.regex", "--regex").

    Example:
        >>> StructuredOutput("regex", source=r"\\d{3}", field="--regex").kind
        'regex'
    """

    kind: Kind
    source: str | None = None
    choices: tuple[str, ...] = ()
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(self.field, f"{self.field}: unknown kind {self.kind!r}")
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise GrammarError(self.field, f"{self.field} must be a list of non-empty strings")
            if len(self.choices) > MAX_CHOICES:
                raise GrammarError(
                    self.field, f"{self.field} holds {len(self.choices)} choices; at most "
                    f"{MAX_CHOICES} are allowed",
                )  # fmt: skip
        elif self.kind != "json_object" and not isinstance(self.source, str):
            raise GrammarError(self.field, f"{self.field} must be a string")
        size = len((self.source or "").encode()) + sum(len(c.encode()) for c in self.choices)
        if size > MAX_SOURCE_BYTES:
            raise GrammarError(
                self.field, f"{self.field} is {size} bytes; at most {MAX_SOURCE_BYTES} are allowed"
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, field: str) -> StructuredOutput:
        """A JSON Schema given as a mapping or as JSON text."""
        if isinstance(schema, dict | bool):
            schema = json.dumps(schema)
        return cls("json_schema", source=schema, field=field)


class GrammarMatcher:
    """One request's matcher (the spec's `TokenMatcher`) over an xgrammar automaton."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: Tensor) -> None:
        """Write the allowed next tokens into a `[words]` int32 row (MASK-LAYOUT-1);
        none once a stop token was accepted (xgrammar raises there instead)."""
        if self._matcher.is_terminated():
            bitmask.zero_()
        else:
            self._matcher.fill_next_token_bitmask(bitmask[None], 0)

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class Grammars:
    """Compiles structured outputs for one tokenizer and makes their matchers.

    Its tables over the vocabulary are built on first use (about 50 ms for
    49,152 tokens), so an engine that never sees a grammar never pays for them.
    Special tokens are never text: a grammar allows them only as its stop
    tokens, the model's EOS ids.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgrammar.GrammarCompiler | None = None

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar  # imported on first use: a server without grammars never loads it

            special = self.tokenizer.special_token_ids
            vocab = [
                b"" if i in special else self.tokenizer.token_bytes(i)
                for i in range(self.tokenizer.vocab_size)
            ]
            info = xgrammar.TokenizerInfo(
                vocab,
                xgrammar.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.tokenizer.eos_token_ids),
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, output: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar (xgrammar's, cached by it), or `GrammarError` for a
        source that does not compile."""
        if output.kind == "json_schema":
            check_schema(output.source, output.field)
        compiler = self._xgrammar_compiler()
        try:
            if output.kind == "json_schema":
                compiled = compiler.compile_json_schema(output.source, **JSON_FORMAT)
            elif output.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', **JSON_FORMAT)
            elif output.kind == "regex":
                compiled = compiler.compile_regex(output.source)
            elif output.kind == "grammar":
                compiled = compiler.compile_grammar(output.source)
            else:
                compiled = compiler.compile_grammar(_choice_grammar(output.choices))
        except (RuntimeError, ValueError, TypeError) as error:
            message = _LOCATION.sub("", str(error).strip()).splitlines()[0]
            raise GrammarError(output.field, f"{output.field}: {message}") from None
        return compiled

    def matcher(self, output: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request (`compile`'s errors included), or
        `GrammarError` if its first step allows no token: the grammar admits no string
        (left recursion without a base case, an empty character class)."""
        import xgrammar

        matcher = GrammarMatcher(xgrammar.GrammarMatcher(self.compile(output)))
        first = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        matcher.fill_bitmask(first)  # filling does not advance the matcher
        if not bool(first.any()):
            raise GrammarError(output.field, f"{output.field}: the grammar admits no string")
        return matcher


def check_schema(source: str, field: str) -> None:
    """A JSON Schema this engine can enforce: JSON text, valid under the JSON Schema
    meta-schema (2020-12), without UNSUPPORTED_KEYWORDS or references outside itself.

    Raises:
        GrammarError: naming `field`, the keyword and where it is ("at /properties/a").
    """
    import jsonschema  # only a request with a schema needs it

    try:
        schema = json.loads(source)
    except json.JSONDecodeError as error:
        raise GrammarError(field, f"{field}: not JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(field, f"{field}: a JSON Schema is an object or a boolean")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/" + "/".join(str(p) for p in error.path)
        raise GrammarError(
            field, f"{field}: not a valid JSON Schema at {where}: {error.message}"
        ) from None
    _check_keywords(schema, field, "")


def _check_keywords(schema: object, field: str, where: str) -> None:
    if not isinstance(schema, dict):
        return
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            raise GrammarError(
                field,
                f"{field}: {keyword!r} (at {where or '/'}) is not supported: a grammar cannot "
                "enforce it",
            )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise GrammarError(
            field, f"{field}: $ref {ref!r} (at {where or '/'}): only references inside the "
            "schema (#/...) are supported",
        )  # fmt: skip
    for key in _SUBSCHEMA:
        _check_keywords(schema.get(key), field, f"{where}/{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, item in enumerate(schema[key]):
                _check_keywords(item, field, f"{where}/{key}/{i}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, item in schema[key].items():
                _check_keywords(item, field, f"{where}/{key}/{name}")


def _choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices`: JSON string literals are valid EBNF ones."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
