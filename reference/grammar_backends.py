"""The grammar libraries behind `reference/grammar.py`: llguidance and xgrammar.

Each backend compiles a `StructuredOutput` for one vocabulary and makes
per-request matchers (the spec's `TokenMatcher`, MASK-MATCHER-1) that fill the
packed int32 bitmask of MASK-LAYOUT-1. Both build their tables over the
vocabulary on first use, so an engine that never sees a grammar never pays
for them. Special tokens are never text: a grammar allows them only as its
stop tokens, the model's EOS ids.

JSON layout (MASK-JSON-1): at most `MAX_JSON_WHITESPACE` whitespace
characters wherever JSON allows whitespace, in either library. Why that
bound, and not any whitespace or none, is measured in `make bench-structured`
(docs/structured.md).

A source that does not compile raises `CompileError` with the library's
message (`GrammarCompiler` names the request field). Which JSON Schema keywords each
backend may see is `schema_policy`'s business, checked before `compile`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from .tokenizer import Tokenizer

BACKENDS = ("llguidance", "xgrammar")
# At most this many whitespace characters wherever JSON allows whitespace. Measured by
# `make bench-structured` on the bundled model (50 prompts, 4 schemas, llguidance):
# bounds of 0, 1, 4 and 24 all gave 100% schema-valid answers that finished "stop"; 0
# took the fewest tokens (31.9 an answer against 38.7), but xgrammar's compact layout
# refuses `{"a":[1,2]}` under {"type": "object"} (it wants ", " inside the nested
# array), and 1 has the model write `"x"\n,"age"`. 4 keeps the layout the model learned
# (a newline and an indent) and no room for the runs of blank lines that 24 allowed.
MAX_JSON_WHITESPACE = 4

# xgrammar's C++ errors start with a time stamp and a source location:
# "[11:38:31] /project/cpp/regex_converter.cc:83: Regex parsing error ...".
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class CompileError(ValueError):
    """A source the library does not compile, or would enforce only in part."""


def _message(error: BaseException | str) -> str:
    """A library's error as one line, without xgrammar's time stamp and source location."""
    return " ".join(_LOCATION.sub("", str(error).strip()).split())


def _choice_ebnf(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices`: JSON string literals are valid EBNF ones."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _vocabulary(tokenizer: Tokenizer) -> list[bytes]:
    special = tokenizer.special_token_ids
    return [b"" if i in special else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]


class Utf8Guard:
    """The tokens that would spell a UTF-16 surrogate (U+D800-U+DFFF) in UTF-8.

    xgrammar's byte-level automaton takes any continuation byte after 0xED, so over
    a vocabulary with byte tokens it admits "\\xed\\xa0\\x80", which is not UTF-8: a
    JSON string of it does not decode, let alone validate (MASK-SOUND-1; found by
    tests/grammar/test_soundness.py, about 1 walk in 8 of {"type": "string"} over
    bytes). UTF-8 allows only 0x80-0x9F after 0xED. `inside` holds the tokens that
    spell one whole; `after_ed` those that complete one when the text so far ends
    in a 0xED lead byte (`ends_in_ed`). Packed as `[words]` int32 rows of the tokens
    still allowed (MASK-LAYOUT-1)."""

    def __init__(self, vocabulary: Sequence[bytes], words: int) -> None:
        import torch

        surrogate = re.compile(rb"\xed[\xa0-\xbf]")
        inside = [bool(surrogate.search(b)) for b in vocabulary]
        after_ed = [bool(b) and 0xA0 <= b[0] <= 0xBF for b in vocabulary]
        self.ends_in_ed = [b.endswith(b"\xed") for b in vocabulary]
        self.inside = frozenset(i for i, bad in enumerate(inside) if bad)
        self.after_ed = frozenset(i for i, bad in enumerate(after_ed) if bad)
        self.allowed = self._pack(torch, inside, words)
        self.allowed_after_ed = self._pack(
            torch, [a or b for a, b in zip(inside, after_ed, strict=True)], words
        )

    @staticmethod
    def _pack(torch: object, forbidden: Sequence[bool], words: int) -> Tensor:
        bits = torch.ones(words * 32, dtype=torch.bool)
        bits[: len(forbidden)] = ~torch.tensor(forbidden, dtype=torch.bool)
        weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
        packed = (bits.view(words, 32).to(torch.int64) * weights).sum(1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class XGrammarMatcher:
    """One request's matcher over an xgrammar automaton, its UTF-8 guarded
    (`Utf8Guard`): what the guard refuses is neither in the mask nor accepted."""

    def __init__(self, matcher: object, guard: Utf8Guard) -> None:
        self._matcher = matcher
        self._guard = guard
        self._ends_in_ed = [False]  # after each accepted token; rolled back with them

    def fill_bitmask(self, bitmask: Tensor) -> None:
        """Write the allowed next tokens into a `[words]` int32 row (MASK-LAYOUT-1);
        none once a stop token was accepted (xgrammar raises there instead)."""
        if self._matcher.is_terminated():
            bitmask.zero_()
            return
        self._matcher.fill_next_token_bitmask(bitmask[None], 0)
        guard = self._guard
        bitmask &= guard.allowed_after_ed if self._ends_in_ed[-1] else guard.allowed

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated() or token_id in self._guard.inside:
            return False
        if self._ends_in_ed[-1] and token_id in self._guard.after_ed:
            return False
        if not self._matcher.accept_token(token_id):
            return False
        ends = self._guard.ends_in_ed  # a special token (b"") or a padded id: no 0xED
        self._ends_in_ed.append(ends[token_id] if token_id < len(ends) else False)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._ends_in_ed[-num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    """xgrammar: vLLM's default; its EBNF is llama.cpp's GBNF."""

    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: object = None
        self._guard: Utf8Guard | None = None

    def _xgrammar_compiler(self) -> object:
        if self._compiler is None:
            import xgrammar  # imported on first use: a server without grammars never loads it

            info = xgrammar.TokenizerInfo(
                _vocabulary(self.tokenizer),
                xgrammar.VocabType.RAW,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.tokenizer.eos_token_ids),
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, kind: str, source: str | None, choices: Sequence[str]) -> object:
        """A grammar of `kind` ("json_schema", "json_object", "regex", "grammar" or
        "choice") from `source` or `choices`, as `StructuredOutput` holds them."""
        compiler = self._xgrammar_compiler()
        layout = {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE}
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(source, **layout)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', **layout)
            if kind == "regex":
                return compiler.compile_regex(source)
            if kind == "grammar":
                return compiler.compile_grammar(source)
            return compiler.compile_grammar(_choice_ebnf(choices))
        except (RuntimeError, ValueError, TypeError) as error:
            raise CompileError(_message(error)) from None

    def matcher(self, compiled: object) -> XGrammarMatcher:
        import xgrammar

        if self._guard is None:
            self._guard = Utf8Guard(_vocabulary(self.tokenizer), (self.vocab_size + 31) // 32)
        return XGrammarMatcher(xgrammar.GrammarMatcher(compiled), self._guard)


class _LLGuidanceVocabulary:
    """What `llguidance.TokenizerWrapper` reads: the token bytes, EOS, BOS, specials,
    and an encoder (llguidance tokenizes only the literals of a grammar with it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)  # not every model has one
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


class LLGuidanceMatcher:
    """One request's matcher over an llguidance parser.

    A token the grammar does not allow is refused without consuming it
    (`try_consume_tokens`), so the parser never enters llguidance's error state.
    llguidance stops by itself once nothing can follow (after `2` under
    `{"const": 2}`) and then allows only the stop tokens, which it does not take
    as a token of its own: such a stop token is recorded here (`_virtual`), so
    that the matcher terminates on it as MASK-MATCHER-1 says and `rollback`
    undoes it like any other token.
    """

    def __init__(self, matcher: object, stop_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = frozenset(stop_token_ids)
        self._virtual: list[bool] = []  # per accepted token: taken here, not by llguidance
        self._terminated = False

    def fill_bitmask(self, bitmask: Tensor) -> None:
        import llguidance.torch

        if self._terminated:
            bitmask.zero_()
        else:
            llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask[None], 0)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        if self._matcher.is_stopped():
            # Stopped but not accepting: the grammar admits no string from here.
            if token_id not in self._stop_token_ids or not self._matcher.is_accepting():
                return False
            self._virtual.append(True)
        elif self._matcher.try_consume_tokens([token_id]) == 1:
            self._virtual.append(False)
        else:
            return False
        self._terminated = token_id in self._stop_token_ids
        return True

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        taken = self._virtual[-num_tokens:]
        del self._virtual[-num_tokens:]
        real = taken.count(False)
        if real:
            self._matcher.rollback(real)
        self._terminated = False  # only the last token can be a stop token

    def is_terminated(self) -> bool:
        return self._terminated


def _lark(ebnf: str) -> str:
    """GBNF as llguidance's Lark; `CompileError` for text that is not GBNF."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(ebnf)
    except Exception as error:  # its parser raises bare Exceptions ("Rule 'x' not found")
        raise CompileError(f"not an EBNF grammar: {_message(error)}") from None


class LLGuidanceBackend:
    """llguidance: Microsoft's Guidance engine, also in vLLM and llama.cpp. It refuses a
    JSON Schema keyword it cannot enforce instead of ignoring it."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: object = None

    def _ll_tokenizer(self) -> object:
        if self._tokenizer is None:
            import llguidance

            wrapper = llguidance.TokenizerWrapper(_LLGuidanceVocabulary(self.tokenizer))
            self._tokenizer = llguidance.LLTokenizer(
                wrapper, n_vocab=self.vocab_size, eos_token=list(self.tokenizer.eos_token_ids)
            )
        return self._tokenizer

    def compile(self, kind: str, source: str | None, choices: Sequence[str]) -> str:
        """As `XGrammarBackend.compile`; a grammar llguidance warns about is refused."""
        import llguidance

        json_layout = {
            "whitespace_flexible": True,
            "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}",
        }
        try:
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    source, overrides=json_layout
                )
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', overrides=json_layout
                )
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(source)
            elif kind == "grammar":
                # The EBNF dialect is llama.cpp's GBNF, as xgrammar's; llguidance reads Lark.
                grammar = llguidance.LLMatcher.grammar_from_lark(_lark(source))
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(_lark(_choice_ebnf(choices)))
        except (RuntimeError, ValueError, TypeError) as error:
            raise CompileError(_message(error)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._ll_tokenizer()
        )
        if is_error or messages:
            # A warning is a part of the grammar llguidance would not enforce: refused.
            raise CompileError(_message(messages[0] if messages else "does not compile"))
        return grammar

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self._ll_tokenizer(), compiled)
        if matcher.is_error():
            raise RuntimeError(f"llguidance: {matcher.get_error()}")
        return LLGuidanceMatcher(matcher, self.tokenizer.eos_token_ids)


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> object:
    """The backend called `name` (one of BACKENDS), or ValueError naming the choices."""
    if name == "llguidance":
        return LLGuidanceBackend(tokenizer, vocab_size)
    if name == "xgrammar":
        return XGrammarBackend(tokenizer, vocab_size)
    raise ValueError(f"grammar_backend must be one of {', '.join(BACKENDS)}, got {name!r}")
