"""UniqueKeys: a JSON grammar's matcher that allows no duplicate object key (MASK-KEYS-1).

The inner matchers are xgrammar's, compiled over a small vocabulary of raw
bytes: every printable ASCII character, a few tokens that hold whole keys or
more (`"a":`, `, "a"`, `{"a": 1, "a"`, `}, "a"`), an escape that spells a
key another way (`\\u0061`), "é" whole and in its two UTF-8 bytes, and EOS.
The wrapper's mask is checked against an oracle that lexes the text with a
regular expression and decodes whole keys with `json.loads`.
"""

from __future__ import annotations

import doctest
import json
import random
import re

import pytest
import torch
import xgrammar
from hypothesis import event, given
from hypothesis import strategies as st

from decodespec.reference import unique_keys
from decodespec.reference.unique_keys import QuoteTokens, UniqueKeys
from decodespec.spec.token_mask import allowed_token_mask, bitmask_words

pytestmark = pytest.mark.clause("MASK-KEYS-1")

KEY_TOKENS = [
    b'"a"', b'"a":', b'"a": ', b', "a"', b'"b"', b'"b":', b'a"', b'"a', b"\\u0061", b'"\\u0061"',
    b'{"a": 1, "a"', b'"a": 1, "a"', b'}, "a"', b'", "a"', b'1, "a": ', b'{"a"', b'", "b": "',
    b'": 1, "a"', "é".encode(), b"\xc3", b"\xa9",
]  # fmt: skip
VOCAB = [bytes([c]) for c in range(0x20, 0x7F)] + KEY_TOKENS + [b""]
EOS = len(VOCAB) - 1
ID = {data: i for i, data in enumerate(VOCAB)}
TABLE = QuoteTokens(VOCAB)
COMPILER = xgrammar.GrammarCompiler(
    xgrammar.TokenizerInfo(
        VOCAB, xgrammar.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[EOS]
    ),
    max_threads=1,
)
SCHEMAS = {
    kind: COMPILER.compile_json_schema(
        json.dumps({"type": kind}), any_whitespace=True, max_whitespace_cnt=2
    )
    for kind in ("object", "array")
}


class XgrammarMatcher:
    """xgrammar's matcher as the spec's TokenMatcher (MASK-MATCHER-1)."""

    def __init__(self, kind: str) -> None:
        self._matcher = xgrammar.GrammarMatcher(SCHEMAS[kind])

    def fill_bitmask(self, bitmask):
        if self._matcher.is_terminated():  # xgrammar raises there
            bitmask.zero_()
        else:
            self._matcher.fill_next_token_bitmask(bitmask[None], 0)

    def accept_token(self, token_id):
        return not self._matcher.is_terminated() and self._matcher.accept_token(token_id)

    def rollback(self, num_tokens):
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self):
        return self._matcher.is_terminated()


def matchers(kind: str = "object") -> tuple[XgrammarMatcher, UniqueKeys]:
    """An inner matcher and a UniqueKeys over another one of the same grammar."""
    return XgrammarMatcher(kind), UniqueKeys(XgrammarMatcher(kind), TABLE)


def allowed(matcher) -> set[int]:
    row = torch.zeros(bitmask_words(len(VOCAB)), dtype=torch.int32)
    matcher.fill_bitmask(row)
    return set(allowed_token_mask(row[None], len(VOCAB))[0].nonzero().flatten().tolist())


def accept(matcher, *pieces: bytes) -> None:
    for piece in pieces:
        assert matcher.accept_token(ID[piece]), piece


# The oracle: JSON's lexemes; a lone `"` opens the string the text ends in.
LEXEME = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\],:]|[^"{}\[\],:]+|"')


def has_duplicate_key(text: str) -> bool:
    """Whether a JSON prefix holds an object with a whole key twice."""
    stack: list[set | None] = []
    expect_key = False
    for lexeme in LEXEME.findall(text):
        if lexeme == '"':
            break
        if lexeme in "{[":
            stack.append(set() if lexeme == "{" else None)
            expect_key = lexeme == "{"
        elif lexeme in "}]":
            stack.pop()
        elif lexeme == ",":
            expect_key = stack[-1] is not None
        elif expect_key and len(lexeme) > 1 and lexeme[0] == '"':
            key = json.loads(lexeme)
            if key in stack[-1]:
                return True
            stack[-1].add(key)
            expect_key = False
    return False


def no_duplicates(pairs: list) -> dict:
    keys = [key for key, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


@given(seed=st.integers(0, 2**32 - 1), wind_down=st.integers(5, 60))
def test_random_walks_emit_no_duplicate_key(seed, wind_down):
    """At every step the mask is the inner one less exactly the tokens that complete a
    duplicate key, never empty; a rollback gives back the mask from before; a finished
    text parses with no duplicate at any depth. Walks favour the key tokens, roll back
    now and then, and after `wind_down` steps close what they can."""
    rng = random.Random(seed)
    inner, keys = matchers()
    text, history = b"", []  # the text and the mask before each accepted token
    for step in range(300):
        mask, inner_mask = allowed(keys), allowed(inner)
        assert mask, text
        assert mask <= inner_mask
        for token in inner_mask - mask:
            assert not keys.accept_token(token)
        for token in inner_mask:
            if b'"' in VOCAB[token]:
                duplicate = has_duplicate_key((text + VOCAB[token]).decode(errors="replace"))
                assert (token not in mask) == duplicate, (text, VOCAB[token])
        if step and inner_mask - mask:  # step 0 always removes `{"a": 1, "a"`
            event("a duplicate key removed after the first step")
        if history and rng.random() < 0.1:
            n = rng.randint(1, min(3, len(history)))
            keys.rollback(n)
            inner.rollback(n)
            text, before = history[-n]
            del history[-n:]
            assert allowed(keys) == before
            continue
        closers = mask & {ID[b"}"], ID[b"]"], ID[b'"'], EOS}
        keyish = mask & {ID[t] for t in KEY_TOKENS}
        if step >= wind_down and closers:
            token = rng.choice(sorted(closers))
        elif keyish and rng.random() < 0.5:
            token = rng.choice(sorted(keyish))
        else:
            token = rng.choice(sorted(mask))
        assert keys.accept_token(token) and inner.accept_token(token)
        if token == EOS:
            json.loads(text, object_pairs_hook=no_duplicates)
            assert keys.is_terminated() and not allowed(keys)
            return
        history.append((text, mask))
        text += VOCAB[token]
    pytest.fail(f"no EOS in 300 steps: {text!r}")


def test_a_key_already_in_the_object_is_not_allowed():
    _, keys = matchers()
    accept(keys, b"{", b'"a"', b":", b" ", b"1", b",", b" ")
    mask = allowed(keys)
    for token in (b'"a"', b'"a":', b'"a": ', b'"a": 1, "a"', b'"\\u0061"'):
        assert ID[token] not in mask, token
    for token in (b'"b"', b'"b":', b'"a', b'"'):
        assert ID[token] in mask, token
    accept(keys, b'"')  # inside the key: `a"` would end it as "a", `a` might go on
    mask = allowed(keys)
    assert ID[b'a"'] not in mask and {ID[b"a"], ID[b"b"], ID[b"\\u0061"]} <= mask
    accept(keys, b"\\u0061")
    assert ID[b'"'] not in allowed(keys) and ID[b"b"] in allowed(keys)


def test_a_token_that_completes_two_keys_is_checked_for_both():
    _, keys = matchers()
    assert ID[b'{"a": 1, "a"'] not in allowed(keys)
    assert not keys.accept_token(ID[b'{"a": 1, "a"'])
    accept(keys, b"{", b'"')
    assert ID[b'": 1, "a"'] in allowed(keys)  # key "" and then "a": no duplicate
    accept(keys, b"a")
    assert ID[b'": 1, "a"'] not in allowed(keys)  # key "a" and then "a" again
    accept(keys, b'"', b":", b" ", b'"')  # inside a value: a key takes three quotes
    assert ID[b'", "a"'] not in allowed(keys) and ID[b'", "b": "'] in allowed(keys)
    accept(keys, b'", "b": "', b"x", b'"', b",", b" ", b'"', b"c")
    assert ID[b'": 1, "a"'] not in allowed(keys)  # key "c" is new, "a" is not


def test_a_key_is_decoded_before_it_is_compared():
    _, keys = matchers()
    accept(keys, b"{", b'"', "é".encode(), b'"', b":", b"1", b",", b'"')
    assert ID[b'"'] in allowed(keys)
    accept(keys, b"\xc3", b"\xa9")  # é in two tokens, one UTF-8 byte each
    assert ID[b'"'] not in allowed(keys)
    accept(keys, b"e", b'"', b":", b"2", b",", b'"\\u0061"', b":", b"3", b",")
    assert ID[b'"a"'] not in allowed(keys)


def test_an_object_with_more_keys_than_key_ending_tokens():
    """Past a few keys, a fill looks each token's key up among them, not each key among
    the tokens: both find the same ones."""
    _, keys = matchers()
    accept(keys, b"{")
    for name in b"cdefghij":
        accept(keys, b'"', bytes([name]), b'"', b":", b"1", b",")
    accept(keys, b'"b"', b":", b"2", b",", b" ")
    mask = allowed(keys)
    assert {ID[b'"a"'], ID[b'"a":']} <= mask and not {ID[b'"b"'], ID[b'"b":']} & mask
    accept(keys, b'"')
    assert ID[b'a"'] in allowed(keys) and ID[b'"'] in allowed(keys)
    accept(keys, b"c")
    assert ID[b'"'] not in allowed(keys)


def test_nested_objects_have_their_own_keys():
    _, keys = matchers()
    accept(keys, b"{", b'"a"', b":", b" ", b"{", b'"a"', b":", b" ", b"1")
    assert ID[b'}, "a"'] not in allowed(keys)  # closes the inner object: "a" is the outer's
    accept(keys, b"}")
    assert ID[b', "a"'] not in allowed(keys)
    accept(keys, b"}")
    assert keys.accept_token(EOS)


def test_each_object_of_an_array_has_its_own_keys():
    _, keys = matchers("array")
    accept(keys, b"[", b'{"a"', b":", b" ", b"1", b"}", b",", b" ", b"{", b'"a"', b":")
    accept(keys, b" ", b"2", b",", b" ")
    assert ID[b'"a"'] not in allowed(keys)
    accept(keys, b'"b"', b":", b"3", b"}", b"]")
    assert keys.accept_token(EOS)


def test_rollback_restores_the_keys():
    _, keys = matchers()
    accept(keys, b"{")
    before = allowed(keys)
    accept(keys, b'"a"', b":", b" ", b"1", b",", b" ")
    assert ID[b'"a"'] not in allowed(keys)
    keys.rollback(6)
    assert allowed(keys) == before
    accept(keys, b'"b"', b":", b" ", b"1", b",", b" ")
    assert ID[b'"a"'] in allowed(keys) and ID[b'"b"'] not in allowed(keys)
    keys.rollback(0)
    assert ID[b'"b"'] not in allowed(keys)
    with pytest.raises(ValueError, match="cannot roll back 8"):
        keys.rollback(8)


def test_a_duplicate_key_token_is_refused_and_changes_nothing():
    inner, keys = matchers()
    path = (b"{", b'"a"', b":", b" ", b"1", b",", b" ")
    accept(keys, *path)
    accept(inner, *path)
    before = allowed(keys)
    assert ID[b'"a"'] in allowed(inner)
    assert not keys.accept_token(ID[b'"a"'])
    assert not keys.accept_token(ID[b'"a": 1, "a"'])
    assert allowed(keys) == before
    accept(keys, b'"b"', b":", b"2", b"}")
    assert keys.accept_token(EOS) and keys.is_terminated()


def test_docstring_examples_run():
    result = doctest.testmod(unique_keys)
    assert result.attempted and not result.failed
