"""Every pattern a schema can carry, checked against its near misses (MASK-SOUND-1).

The random walks of test_soundness.py find a grammar that admits too much only
when a walk happens to spell the wrong string: xgrammar's `time` pattern let a
fraction through without its dot (`"22:14:2890986486Z"`, issue 64), and the
derandomized CI profile never drew that walk. Here each pattern is checked by
strings built from its parse tree instead: near misses, each one edit away
from a match (a literal character replaced by another or left out, a
character class given a character outside it, a bounded repeat one too long
or one too short), kept where Python's `re` rejects them, must be refused by
the compiled grammar of both backends; the matches the edits start from must
be admitted, so that a grammar that admits nothing cannot pass.

The patterns are the ones the schema policy hands over for `date`, `time` and
`date-time` (asked for as `format`, as a request does), the `pattern`s the
property test generates, and user patterns of the shapes xgrammar got wrong
(an optional group that holds a repeat) or that a rewrite of them could break
(an escaped `?`, a `?` in a class, a lazy `??`, a non-capturing group).
"""

from __future__ import annotations

import functools
import json
import re
import string
from collections.abc import Iterator

import pytest

from decodespec.reference.grammar import GrammarCompiler, GrammarError, StructuredOutput
from decodespec.reference.grammar_backends import BACKENDS
from decodespec.reference.schema_policy import FORMAT_PATTERNS
from tests.engine.toy import ByteTokenizer
from tests.grammar.schema_suite import matcher_accepts
from tests.grammar.test_soundness import PATTERNS

try:
    from re import _parser as sre_parse  # Python 3.11+
except ImportError:  # Python 3.10
    import sre_parse

USER_PATTERNS = (
    r"^a(x[0-9]+)?c$",
    r"^(a+b)?$",
    r"^(?:ab+)?c$",
    r"^[0-9]+(\.[0-9]{1,2})?$",
    r"^a(b+)??c$",
    r"^why\?( not)?$",
    r"^[?a]+(b[0-9]*)?$",
)
# The characters a near miss may put in: printable ASCII, none that JSON escapes.
CANDIDATES = string.digits + string.ascii_letters + "-.:_+ /!#$%&'()*,;<=>?@[]^`{|}~"
_CATEGORIES = {
    sre_parse.CATEGORY_DIGIT: r"\d",
    sre_parse.CATEGORY_NOT_DIGIT: r"\D",
    sre_parse.CATEGORY_WORD: r"\w",
    sre_parse.CATEGORY_NOT_WORD: r"\W",
    sre_parse.CATEGORY_SPACE: r"\s",
    sre_parse.CATEGORY_NOT_SPACE: r"\S",
}


def _in_class(items: list, char: str) -> bool:
    """Whether `char` is in the character class of sre's `IN` items."""
    negate = bool(items) and items[0][0] is sre_parse.NEGATE
    found = False
    for op, av in items[negate:]:
        if op is sre_parse.LITERAL:
            found |= ord(char) == av
        elif op is sre_parse.RANGE:
            found |= av[0] <= ord(char) <= av[1]
        elif op is sre_parse.CATEGORY:
            found |= re.fullmatch(_CATEGORIES[av], char) is not None
        else:
            raise NotImplementedError(f"class item {op}")
    return found != negate


def _render(items: list, path: tuple, target: tuple | None, edit: object, long: bool) -> str:
    """A string of the parsed `items` at `path` in the tree: through the node at
    `target` (the branch that holds it, a repeat that holds it at least once), with
    `edit` applied there (None: no edit); every other repeat at its lower bound, or
    with `long` at its upper one (its lower bound + 2 when unbounded)."""
    out = []
    for i, (op, av) in enumerate(items):
        here = (*path, i)
        inside = target is not None and target[: len(here)] == here
        edited = inside and target == here and edit is not None
        if op is sre_parse.AT:
            continue
        if op is sre_parse.LITERAL:
            out.append("" if edited and edit == "drop" else edit if edited else chr(av))
        elif op is sre_parse.NOT_LITERAL:
            out.append(chr(av) if edited else next(c for c in CANDIDATES if ord(c) != av))
        elif op is sre_parse.ANY:
            out.append("a")
        elif op is sre_parse.IN:
            out.append(edit if edited else next(c for c in CANDIDATES if _in_class(av, c)))
        elif op is sre_parse.SUBPATTERN:
            out.append(_render(av[3], here, target if inside else None, edit, long))
        elif op is sre_parse.BRANCH:
            pick = target[len(here)] if inside and len(target) > len(here) else 0
            out.append(_render(av[1][pick], (*here, pick), target if inside else None, edit, long))
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            low, high, sub = av
            if edited:
                count = edit
            else:
                count = (low + 2 if high is sre_parse.MAXREPEAT else high) if long else low
                count = max(count, 1) if inside else count
            # The first copy goes through `target`; the others are plain.
            copies = [_render(sub, here, target if inside and not edited else None, edit, long)]
            copies += [_render(sub, here, None, None, long) for _ in range(count - 1)]
            out.append("".join(copies[:count]))
        else:
            raise NotImplementedError(f"regex node {op} in a test pattern")
    return "".join(out)


def _edits(items: list, path: tuple = ()) -> Iterator[tuple[tuple, object]]:
    """(place, edit) of every near-miss edit in the parsed `items`."""
    for i, (op, av) in enumerate(items):
        here = (*path, i)
        if op is sre_parse.LITERAL:
            yield here, "drop"
            yield here, next(c for c in CANDIDATES if ord(c) != av)
        elif op is sre_parse.NOT_LITERAL:
            yield here, "is"
        elif op is sre_parse.IN:
            outside = [c for c in CANDIDATES if not _in_class(av, c)]
            yield from ((here, c) for c in outside[:1])
        elif op is sre_parse.SUBPATTERN:
            yield from _edits(av[3], here)
        elif op is sre_parse.BRANCH:
            for k, alternative in enumerate(av[1]):
                yield from _edits(alternative, (*here, k))
        elif op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT):
            low, high, sub = av
            if high is not sre_parse.MAXREPEAT:
                yield here, high + 1
            if low > 0:
                yield here, low - 1
            yield from _edits(sub, here)


def matches_and_near_misses(pattern: str) -> tuple[set[str], set[str]]:
    """Strings that match `pattern` through each of its nodes, and its near misses:
    each one edit away from such a match, and rejected by Python's `re` (an edit
    may land on another match: a dropped optional digit)."""
    tree = list(sre_parse.parse(pattern))
    compiled = re.compile(pattern)
    matches, near_misses = set(), set()
    for place, edit in _edits(tree):
        for long in (False, True):
            matches.add(_render(tree, (), place, None, long))
            candidate = _render(tree, (), place, edit, long)
            if not compiled.fullmatch(candidate):
                near_misses.add(candidate)
    assert all(compiled.fullmatch(m) for m in matches), "the renderer broke a match"
    return matches, near_misses


@functools.cache
def grammars(backend: str) -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(), ByteTokenizer.vocab_size, backend)


SCHEMAS = [
    pytest.param({"type": "string", "format": name}, pattern, id=f"format-{name}")
    for name, pattern in FORMAT_PATTERNS.items()
] + [
    pytest.param({"type": "string", "pattern": pattern}, pattern, id=f"pattern-{pattern}")
    for pattern in (*PATTERNS, *USER_PATTERNS)
]


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("schema", "pattern"), SCHEMAS)
def test_the_compiled_pattern_rejects_every_near_miss_and_admits_the_matches(
    backend, schema, pattern
):
    output = StructuredOutput.json_schema(schema, field="schema")
    compiled = grammars(backend).compile(output)
    matches, near_misses = matches_and_near_misses(pattern)
    assert len(near_misses) >= 3, f"too few near misses of {pattern!r} to mean anything"

    def admits(text: str) -> bool:
        return matcher_accepts(grammars(backend), compiled, json.dumps(text))

    admitted = sorted(s for s in near_misses if admits(s))
    assert not admitted, (
        f"{backend} admitted {len(admitted)} of the {len(near_misses)} near misses of "
        f"{pattern!r} ({json.dumps(schema)}), e.g. {admitted[:5]}"
    )
    refused = sorted(s for s in matches if not admits(s))
    assert not refused, f"{backend} refused matches of {pattern!r}: {refused[:5]}"


def test_the_near_misses_include_the_time_that_xgrammar_admitted():
    # Issue 64's string is one edit (the dot left out) from a match of `time`; the
    # renderer spells the same shape: a fraction's digits straight after the seconds.
    _, near_misses = matches_and_near_misses(FORMAT_PATTERNS["time"])
    assert "00:00:000Z" in near_misses
    assert re.fullmatch(FORMAT_PATTERNS["time"], "22:14:2890986486Z") is None


@pytest.mark.clause("MASK-SOUND-1")
@pytest.mark.parametrize(
    ("backend", "refusal"),
    [("llguidance", "look-around"), ("xgrammar", "'pattern' at /properties/x: .* lookahead")],
)
def test_a_pattern_with_a_lookahead_is_refused(backend, refusal):
    # xgrammar ignores a lookahead (a warning on stderr) and would admit "abc" here, so
    # the policy refuses it; llguidance refuses it by itself.
    pattern = {"type": "string", "pattern": "^(?!abc)[a-z]+$"}
    schema = {"type": "object", "properties": {"x": pattern}}
    with pytest.raises(GrammarError, match=refusal):
        grammars(backend).compile(StructuredOutput.json_schema(schema, field="schema"))
