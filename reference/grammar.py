"""Structured outputs: a request's grammar, compiled by a grammar library, as the spec's matcher.

A request may ask for output that matches a JSON Schema, any JSON object, a
regular expression, an EBNF grammar or one of a list of strings
(`StructuredOutput`). `GrammarCompiler` compiles it once, before the request is
queued, with one of two libraries (`grammar_backends`: llguidance by default,
or xgrammar) over this model's vocabulary; each request then gets its own
matcher, which fills the row's token bitmask every step and advances with
every emitted token (the spec's `TokenMatcher`, MASK-MATCHER-1). What the
bitmask does to the logits is the spec's `token_mask` stage, applied inside
`sample` (MASK-SAMPLE-1).

Soundness before coverage (MASK-SOUND-1): every string a compiled schema
admits validates against the schema. A schema whose keywords the library
would enforce only in part is refused, naming the keyword and where it is
(`schema_policy`); JSON output never repeats a key in one object
(`unique_keys`, MASK-KEYS-1).

Why llguidance by default (`make bench-structured`, docs/structured.md): on
the JSON Schema Test Suite both are sound once `schema_policy` refuses what
each would not enforce, and llguidance then compiles more of the suite's
schemas and of JSONSchemaBench's, accepts more of what they allow, and
compiles a schema several times faster, without xgrammar's tail of seconds;
xgrammar fills a mask faster at the median. xgrammar stays a choice
(`--grammar-backend xgrammar`): it is vLLM's default.

Bad input is a `GrammarError` (a `ParameterError` naming the request field
it came from) raised by `compile`, before any model work: a schema that is
not JSON, not valid under the JSON Schema meta-schema, uses a keyword the
backend would not enforce, or a reference outside itself, a regular
expression or grammar that does not parse, a grammar that admits no string,
a source longer than `MAX_SOURCE_BYTES`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from decodespec.spec.checks import ParameterError
from decodespec.spec.token_mask import bitmask_words

from .grammar_backends import CompileError, make_backend
from .schema_policy import SchemaRefused, enforceable_schema
from .unique_keys import QuoteTokens, UniqueKeys

if TYPE_CHECKING:
    from decodespec.spec.token_mask import TokenMatcher

    from .tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "grammar", "choice"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "grammar", "choice")
DEFAULT_BACKEND = "llguidance"

# The largest schema, expression or grammar a request may send: compiling is linear-ish
# in its size, and it runs before the request is queued, on the server's engine thread.
MAX_SOURCE_BYTES = 64 * 1024
MAX_CHOICES = 256


class GrammarError(ParameterError):
    """A structured-output request that cannot be compiled; `.param` is its field."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    Attributes:
        kind: "json_schema" (`source` is the schema as JSON text), "json_object"
            (any JSON object; no source), "regex", "grammar" (EBNF, llama.cpp's
            GBNF dialect, which both libraries read, rule `root`) or "choice" (`choices`).
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


class GrammarCompiler:
    """Compiles structured outputs for one tokenizer, with one grammar library (`backend`,
    one of `grammar_backends.BACKENDS`), and makes their matchers.

    Example:
        >>> grammars = GrammarCompiler(tokenizer, vocab_size=49152)  # doctest: +SKIP
        >>> matcher = grammars.matcher(StructuredOutput("regex", source="yes|no", field="t"))
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, backend: str = DEFAULT_BACKEND
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.backend = make_backend(backend, tokenizer, vocab_size)
        self._quote_tokens: QuoteTokens | None = None  # built with the first JSON grammar

    def compile(self, output: StructuredOutput) -> object:
        """The compiled grammar, or `GrammarError` naming the request field: a schema the
        backend would not enforce whole (`check_schema`), a source that does not compile."""
        if output.kind == "json_schema":
            schema = check_schema(output.source, output.field, self.backend.name)
            output = dataclasses.replace(output, source=json.dumps(schema))
        try:
            return self.backend.compile(output.kind, output.source, output.choices)
        except CompileError as error:
            raise GrammarError(output.field, f"{output.field}: {error}") from None

    def matcher(self, output: StructuredOutput) -> TokenMatcher:
        """A fresh matcher for one request (`compile`'s errors included), or
        `GrammarError` if its first step allows no token: the grammar admits no string
        (left recursion without a base case, an empty character class)."""
        matcher = self.backend.matcher(self.compile(output))
        if output.kind in ("json_schema", "json_object"):
            matcher = UniqueKeys(matcher, self._json_tokens())  # MASK-KEYS-1
        first = torch.zeros(bitmask_words(self.vocab_size), dtype=torch.int32)
        matcher.fill_bitmask(first)  # filling does not advance the matcher
        stop = self.tokenizer.eos_token_ids[0]
        if not (
            first.any()
            and (_allows_text(first, self.tokenizer.eos_token_ids) or matcher.accept_token(stop))
        ):
            # llguidance offers the stop token where nothing can be matched, yet refuses it.
            raise GrammarError(output.field, f"{output.field}: the grammar admits no string")
        if matcher.is_terminated():
            matcher.rollback(1)
        return matcher

    def _json_tokens(self) -> QuoteTokens:
        if self._quote_tokens is None:
            special, size = self.tokenizer.special_token_ids, self.tokenizer.vocab_size
            self._quote_tokens = QuoteTokens(
                [
                    b"" if i in special or i >= size else self.tokenizer.token_bytes(i)
                    for i in range(self.vocab_size)
                ]
            )
        return self._quote_tokens


def _allows_text(bitmask: torch.Tensor, stop_token_ids: tuple[int, ...]) -> bool:
    """Whether a `[words]` mask allows a token that is not a stop token."""
    text = bitmask.clone()
    for token in stop_token_ids:
        text[token // 32] &= ~(1 << (token % 32)) if token % 32 != 31 else 0x7FFFFFFF
    return bool(text.any())


def check_schema(source: str, field: str, backend: str = DEFAULT_BACKEND) -> object:
    """The schema to compile, if `backend` enforces `source` whole: JSON text, valid
    under the JSON Schema meta-schema (2020-12), and every keyword one the backend
    enforces (`schema_policy.enforceable_schema`, which may rewrite a format as a
    pattern).

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
    try:
        return enforceable_schema(schema, backend)
    except SchemaRefused as error:
        raise GrammarError(field, f"{field}: {error}") from None
