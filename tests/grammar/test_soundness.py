"""Soundness of compiled schemas (MASK-SOUND-1): random token paths through a matcher.

For a schema (generated, or one of the issue's) and a backend: compile it as a
request would (a refusal is fine: it is the other half of the clause), then
walk the matcher to its stop token, each step taking a random allowed token
(what sampling does with random logits under the mask), and validate the text
with `jsonschema` (Draft 2020-12, format assertions on). Over both the bundled
vocabulary (49,152 tokens) and a byte vocabulary (256 tokens + EOS), where a
walk spells strings character by character.

A walk prefers single-byte tokens half the time and the stop token when it is
allowed, so that most walks end within `MAX_STEPS`; walks that do not are
dropped (counted as a hypothesis event).
"""

from __future__ import annotations

import functools
import json
import random

import jsonschema
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from decodespec.reference import grammar as grammar_module
from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.spec.token_mask import allowed_token_mask, bitmask_words
from tests.engine.toy import ByteTokenizer
from tests.grammar.test_schema_test_suite import ISSUE_EXAMPLES, bundled_tokenizer

MAX_STEPS = 160
VOCABULARIES = ("bundled", "bytes")


@functools.cache
def grammars(backend: str, vocabulary: str) -> GrammarCompiler:
    tokenizer = bundled_tokenizer() if vocabulary == "bundled" else ByteTokenizer()
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, backend)


@functools.cache
def single_byte_tokens(vocabulary: str) -> torch.Tensor:
    """A `[vocab]` bool mask of the tokens whose text is one byte."""
    tokenizer = grammars("llguidance", vocabulary).tokenizer
    return torch.tensor([len(tokenizer.token_bytes(i)) == 1 for i in range(tokenizer.vocab_size)])


def random_walk(grammars: GrammarCompiler, compiled: object, rng: random.Random) -> str | None:
    """The text of one random path through a fresh matcher to its stop token, or None
    if it did not stop within MAX_STEPS."""
    tokenizer = grammars.tokenizer
    vocabulary = "bundled" if tokenizer.vocab_size > 300 else "bytes"
    matcher = grammars.backend.matcher(compiled)
    row = torch.zeros((grammars.vocab_size + 31) // 32, dtype=torch.int32)
    stop = tokenizer.eos_token_ids[0]
    text = b""
    for _ in range(MAX_STEPS):
        matcher.fill_bitmask(row)
        allowed = allowed_token_mask(row[None], grammars.vocab_size)[0]
        assert allowed.any(), f"no token allowed after {text!r}"
        if allowed[stop] and rng.random() < 0.5:
            token = stop
        else:
            short = allowed & single_byte_tokens(vocabulary)
            pool = short if short.any() and rng.random() < 0.5 else allowed
            candidates = pool.nonzero().flatten().tolist()
            token = candidates[rng.randrange(len(candidates))]
        assert matcher.accept_token(token), f"the mask allowed {token} but the matcher refused"
        if token in tokenizer.eos_token_ids:
            return text.decode()
        text += tokenizer.token_bytes(token)
    return None


def assert_sound(schema: object, backend: str, vocabulary: str, seed: int, walks: int) -> str:
    """Walk `walks` random paths of `schema`'s grammar and validate each completed one;
    returns what happened, for hypothesis's statistics."""
    output = StructuredOutput.json_schema(schema, field="schema")
    try:
        compiled = grammars(backend, vocabulary).compile(output)
    except GrammarError as error:
        return f"refused: {str(error).split(':')[1]}"
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    rng = random.Random(seed)
    finished = 0
    for _ in range(walks):
        text = random_walk(grammars(backend, vocabulary), compiled, rng)
        if text is None:
            continue
        finished += 1
        errors = [e.message for e in validator.iter_errors(json.loads(text))]
        assert not errors, (
            f"{backend} over the {vocabulary} vocabulary admitted {text!r}, which breaks "
            f"{json.dumps(schema)}: {errors}"
        )
    return f"walks finished: {finished}/{walks}"


# ---------------------------------------------------------------- generated schemas

# oneOf is refused by both backends (llguidance reads it as anyOf only when asked to,
# xgrammar silently), so it is left out: every example would be a refusal.
PATTERNS = ("^[a-z]+$", "^[A-Z][a-z]*$", "^(ab|cd)+$", "^[0-9]{2,4}$")
FORMATS = ("date", "time", "date-time", "email", "uuid", "ipv4", "ipv6")


def strings() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"type": st.just("string")},
        optional={
            "minLength": st.integers(0, 3),
            "maxLength": st.integers(3, 8),
            "pattern": st.sampled_from(PATTERNS),
            "format": st.sampled_from(FORMATS),
        },
    )


def numbers() -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"type": st.sampled_from(["integer", "number"])},
        optional={
            "minimum": st.integers(-20, 0),
            "maximum": st.integers(0, 50),
            "exclusiveMaximum": st.integers(1, 60),
            "multipleOf": st.sampled_from([1, 2, 5, 0.5, 0.25]),
        },
    )


def leaves() -> st.SearchStrategy[dict]:
    return st.one_of(
        strings(),
        numbers(),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}]),
        st.lists(
            st.one_of(st.integers(-3, 3), st.text("ab", max_size=2)), min_size=1, max_size=3
        ).map(lambda values: {"enum": values}),
        st.sampled_from([{"const": "x"}, {"const": 7}, {"const": None}]),
    )


def schemas() -> st.SearchStrategy[dict]:
    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        objects = st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3).flatmap(
            lambda props: st.fixed_dictionaries(
                {"type": st.just("object"), "properties": st.just(props)},
                optional={
                    "required": st.lists(st.sampled_from(sorted(props)), unique=True),
                    "additionalProperties": st.sampled_from([False, True, {"type": "integer"}]),
                },
            )
        )
        arrays = st.fixed_dictionaries(
            {"type": st.just("array"), "items": children},
            optional={"minItems": st.integers(0, 2), "maxItems": st.integers(2, 4)},
        )
        any_of = st.lists(children, min_size=2, max_size=3).map(lambda s: {"anyOf": s})
        return st.one_of(objects, objects, arrays, any_of)

    return st.recursive(leaves(), extend, max_leaves=6)


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("vocabulary", VOCABULARIES)
@pytest.mark.parametrize("backend", BACKENDS)
@settings(deadline=None, max_examples=15)
@given(schema=schemas(), seed=st.integers(0, 2**32 - 1))
def test_every_completed_random_path_validates(backend, vocabulary, schema, seed):
    event(assert_sound(schema, backend, vocabulary, seed, walks=3))


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("vocabulary", VOCABULARIES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("example", range(len(ISSUE_EXAMPLES)))
def test_random_paths_of_the_issue_examples_validate(backend, vocabulary, example):
    outcome = assert_sound(ISSUE_EXAMPLES[example][0], backend, vocabulary, example, walks=20)
    assert outcome.startswith("refused") or not outcome.endswith(" 0/20"), outcome


def test_the_walks_find_what_xgrammar_drops_without_the_schema_policy(monkeypatch):
    # The oracle has teeth: with the policy off (the engine before MASK-SOUND-1),
    # xgrammar's grammar of the first example lets a username past maxLength 8 through.
    monkeypatch.setattr(grammar_module, "enforceable_schema", lambda schema, backend: schema)
    schema = ISSUE_EXAMPLES[0][0]
    fresh = GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, "xgrammar")
    with pytest.raises(AssertionError, match="admitted"):
        compiled = fresh.compile(StructuredOutput.json_schema(schema, field="schema"))
        rng = random.Random(0)
        validator = jsonschema.Draft202012Validator(schema)
        for _ in range(200):
            text = random_walk(fresh, compiled, rng)
            if text is not None:
                assert validator.is_valid(json.loads(text)), f"admitted {text!r}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_backend_spells_a_surrogate_in_utf8(backend):
    """After `"` and the lead byte 0xED inside a JSON string, UTF-8 allows only the
    continuation bytes 0x80-0x9F (0xA0-0xBF would spell U+D800-U+DFFF, which no
    UTF-8 decoder takes). xgrammar's automaton takes any continuation byte there;
    the engine's guard (`grammar_backends.Utf8Guard`) refuses the rest, in the mask
    and in `accept_token` alike, and forgets the lead byte on rollback."""
    fresh = GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, backend)
    compiled = fresh.compile(StructuredOutput.json_schema({"type": "string"}, field="s"))
    matcher = fresh.backend.matcher(compiled)
    row = torch.zeros(bitmask_words(ByteTokenizer.vocab_size), dtype=torch.int32)

    def allowed() -> set[int]:
        matcher.fill_bitmask(row)
        mask = allowed_token_mask(row[None], ByteTokenizer.vocab_size)[0]
        return set(mask.nonzero().flatten().tolist())

    assert matcher.accept_token(ord('"'))
    assert 0xED in allowed()
    assert matcher.accept_token(0xED)
    after_lead = allowed()
    assert after_lead == set(range(0x80, 0xA0)), sorted(after_lead)
    assert not matcher.accept_token(0xA0)
    assert matcher.accept_token(0x9F)  # U+D7C0..: the last code points before them
    assert matcher.accept_token(0x80)
    assert 0xA0 not in allowed() and ord("a") in allowed()  # a whole character again
    matcher.rollback(2)
    assert allowed() == after_lead  # the lead byte is pending again
