"""Unique object keys: a matcher wrapper that forbids `{"a": 1, "a": 2}`.

A JSON grammar (any object, or a schema with `additionalProperties` or
`patternProperties`) admits an object with a key twice, which JSON parsers
read differently and an OpenAI-style `json_object` answer must not hold. No
context-free grammar can forbid it, so `UniqueKeys` wraps a JSON grammar's
matcher (the spec's `TokenMatcher`, MASK-MATCHER-1) and scans the text it
accepts: a stack of open containers, each object with its keys, decoded
(`"a"` and `"\\u0061"` are one key), and whether the text ends inside a key
or a value string, after a backslash. Its mask is the inner one less every
token that would complete a key its object already holds, and it refuses to
accept those. `{"a": {"a": 1}}` and `[{"a": 1}, {"a": 2}]` are allowed: each
object has its own keys. Wrap no other grammar's matcher: the text must be JSON.

Only a token with a `"` byte can complete a key: inside a key, one that ends
it; before one (after `{` or `,`), one with two; after or inside a value, one
that gets to a key too (`1, "a"`, `", "a"`: none of SmolLM2's 49,152 tokens).
`QuoteTokens` lists them once per vocabulary; a fill looks up those that end
the key as one its object holds and scans the few others the inner mask
allows: about 2 µs more than the inner fill after or inside a value, 4 µs
before a key, 9 µs inside one (SmolLM2, one CPU thread).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
from torch import Tensor

from decodespec.spec.token_mask import TokenMatcher

# The scanner's modes: between strings, in a value string (after a backslash), in a key
# (after a backslash). An escaped byte never ends the string, whatever it is.
OUT, VALUE, VALUE_ESCAPE, KEY, KEY_ESCAPE = range(5)
QUOTE, BACKSLASH, COMMA, LBRACE = b'"'[0], b"\\"[0], b","[0], b"{"[0]
OPENERS, CLOSERS = frozenset(b"{["), frozenset(b"}]")

# A state is (frame, mode, the key's bytes so far); a frame of the container stack is
# (keys, expect_key, parent), `keys` a frozenset, None for an array, `parent` a frame or
# None. Immutable and linked: a state shares, not copies, what it keeps of the last one.
State = tuple
START: State = (None, OUT, b"")
# `row[t // 32] &= CLEAR[t % 32]` disallows token t (MASK-LAYOUT-1): all bits but t's.
CLEAR = np.array([~(1 << b) if b < 31 else 2**31 - 1 for b in range(32)], dtype=np.int32)


def decode_key(raw: bytes) -> bytes | None:
    """A key's identity, its text in UTF-8, from its bytes between the quotes (`é` and
    `\\u00e9` are one); None if they are no JSON string. Bytes without a backslash
    that follow add to it as they are, unless it is None: a key so far that ends in
    an escape (`\\u00`) or inside a character."""
    if b"\\" not in raw:
        return raw  # JSON text without escapes is its text's UTF-8 already
    try:
        # "surrogatepass": "\\ud800" is a JSON string, and a key of its own.
        return json.loads(f'"{raw.decode()}"', strict=False).encode("utf-8", "surrogatepass")
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None


def scan(state: State, data: bytes) -> State | None:
    """The scanner's state after `data`, or None if `data` completes a key that its
    object already holds.

    Example:
        >>> state = scan(START, b'{"a": 1, "b')
        >>> state[0][0], state[2]
        (frozenset({b'a'}), b'b')
        >>> scan(state, b'": 2, "\\\\u0061"') is None
        True
    """
    frame, mode, key = state
    start = 0  # where the key's bytes in `data` begin
    for i, byte in enumerate(data):
        if mode == OUT:
            if byte == QUOTE:
                if frame is not None and frame[1]:
                    mode, key, start = KEY, b"", i + 1
                else:
                    mode = VALUE
            elif byte in OPENERS:
                frame = (frozenset() if byte == LBRACE else None, byte == LBRACE, frame)
            elif byte in CLOSERS and frame is not None:
                frame = frame[2]
            elif byte == COMMA and frame is not None and frame[0] is not None:
                frame = (frame[0], True, frame[2])
        elif mode == KEY:
            if byte == QUOTE:
                raw = key + data[start:i]
                name = decode_key(raw)
                name = raw if name is None else name  # no JSON string: a key of its own
                if name in frame[0]:
                    return None
                frame, mode, key = (frame[0] | {name}, False, frame[2]), OUT, b""
            elif byte == BACKSLASH:
                mode = KEY_ESCAPE
        elif mode == VALUE:
            if byte == QUOTE:
                mode = OUT
            elif byte == BACKSLASH:
                mode = VALUE_ESCAPE
        else:  # the byte after a backslash
            mode -= 1
    if mode in (KEY, KEY_ESCAPE):
        key += data[start:]
    return frame, mode, key


class _AnyKeys:
    """A key set that holds every key: a scan from objects with it stops at the first
    key that it completes in one of them."""

    def __contains__(self, key: object) -> bool:
        return True


def _own_end(data: bytes, mode: int) -> bytes | None:
    """The bytes with which `data` ends a key, from mode KEY (after the key so far) or
    OUT before a key, if they hold no escape and it completes no other key."""
    if mode == OUT:
        skipped, _, data = data.partition(b'"')
        if any(byte in b"{}[]," for byte in skipped):  # a container or a comma first
            return None
    end, _, rest = data.partition(b'"')
    return end if b"\\" not in end and rest.count(b'"') < 2 else None


class QuoteTokens:
    """A vocabulary's bytes and the tokens that can complete a key, built once (about
    10 ms for 49,152 tokens) and shared by the `UniqueKeys` over it.

    Attributes:
        token_bytes: token i's UTF-8 bytes, b"" for special tokens.
        candidates: by scanner mode and whether the innermost container is an object
            that expects a key, the ids of the tokens that complete a key from there
            in a stack of objects; a real stack (with arrays, where a `"` after `,`
            opens a value) completes fewer. SmolLM2's: 20 before a key, 161 inside.
        ends: for KEY and OUT (before a key), the tokens that end the key with bytes
            of their own and complete no other, by those bytes (`a"` ends key `x` as
            `xa`, `"a":` ends key `a`), and the other candidates (SmolLM2's: 0, 6).
    """

    def __init__(self, token_bytes: Sequence[bytes]) -> None:
        self.token_bytes = token_bytes
        # `QUOTE in`, not `b'"' in`: a byte is found faster than a substring.
        quoted = [t for t, data in enumerate(token_bytes) if QUOTE in data]
        # As many objects around the innermost as any token closes: no scan runs out.
        parents = None
        for _ in range(max((sum(b in CLOSERS for b in token_bytes[t]) for t in quoted), default=0)):
            parents = (_AnyKeys(), False, parents)
        self.candidates: dict[tuple[int, bool], list[int]] = {}
        for mode in range(5):
            for expect_key in (False, True):
                state = ((_AnyKeys(), expect_key, parents), mode, b"")
                self.candidates[mode, expect_key] = [
                    t for t in quoted if scan(state, token_bytes[t]) is None
                ]
        self.ends: dict[int, tuple[dict[bytes, list[int]], list[int]]] = {}
        for mode in (OUT, KEY):
            ends: dict[bytes, list[int]] = {}
            others = []
            for t in self.candidates[mode, True]:
                end = _own_end(token_bytes[t], mode)
                if end is None:
                    others.append(t)
                else:
                    ends.setdefault(end, []).append(t)
            self.ends[mode] = ends, others


class UniqueKeys:
    """A JSON grammar's matcher (MASK-MATCHER-1) that allows no duplicate object key.

    Args:
        matcher: the inner matcher, a JSON grammar's; its mask is filled first.
        tokens: the vocabulary: `token_bytes[i]` is token i's bytes (b"" for a
            special token), or a `QuoteTokens` of it, to share its tables.

    Example:
        The inner matcher allows `{"a": 1, "a": 2}`, token by token; the second
        `"a"` is refused, and the mask after `{"a": 1, ` has no bit for it.

        >>> import torch
        >>> from decodespec.spec.token_mask import ChoiceMatcher
        >>> vocab = [b"{", b'"a"', b": 1, ", b": 2}", b""]
        >>> inner = ChoiceMatcher([[0, 1, 2, 1, 3]], stop_token_ids=[4], vocab_size=5)
        >>> keys = UniqueKeys(inner, vocab)
        >>> [keys.accept_token(t) for t in (0, 1, 2, 1)]
        [True, True, True, False]
        >>> row = torch.zeros(1, dtype=torch.int32)
        >>> keys.fill_bitmask(row); row
        tensor([0], dtype=torch.int32)
    """

    def __init__(self, matcher: TokenMatcher, tokens: QuoteTokens | Sequence[bytes]) -> None:
        self._matcher = matcher
        self._tokens = tokens if isinstance(tokens, QuoteTokens) else QuoteTokens(tokens)
        # The scanner's state after each accepted token, the start's first: rollback pops.
        self._states: list[State] = [START]

    def fill_bitmask(self, bitmask: Tensor) -> None:
        """The inner mask into a `[words]` int32 CPU row (MASK-LAYOUT-1), less the
        tokens that would complete a key their object already holds."""
        self._matcher.fill_bitmask(bitmask)
        tokens = self._tokens
        state = frame, mode, key = self._states[-1]
        expect_key = frame is not None and frame[1]
        prefix = decode_key(key)
        if (mode == KEY or (mode == OUT and expect_key)) and prefix is not None:
            # A token in `ends` makes this key (b"" before it opens) `prefix + end`: it is
            # a duplicate if its object holds that. Looked up, not scanned, nor its bit
            # read, by the object's keys or by the ends, whichever are fewer.
            ends, candidates = tokens.ends[mode]
            names = frame[0]
            if len(names) <= len(ends):
                duplicates = [
                    t
                    for name in names
                    if name.startswith(prefix)
                    for t in ends.get(name[len(prefix) :], ())
                ]
            else:
                duplicates = [t for end, ids in ends.items() if prefix + end in names for t in ids]
        else:
            candidates = tokens.candidates[mode, expect_key]
            duplicates = []
        if not (duplicates or candidates):  # after or inside a value: the common case
            return
        row = bitmask.numpy()  # a view: reading a word costs less (`.item`) than in torch
        for t in candidates:
            if row.item(t // 32) >> (t % 32) & 1 and scan(state, tokens.token_bytes[t]) is None:
                duplicates.append(t)
        for t in duplicates:
            row[t // 32] &= CLEAR[t % 32]

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False, and no change, if the inner matcher refuses it
        or it completes a duplicate key."""
        token_bytes = self._tokens.token_bytes
        # An id past the vocabulary (a padded embedding's) is no text; the inner refuses it.
        data = token_bytes[token_id] if 0 <= token_id < len(token_bytes) else b""
        state = scan(self._states[-1], data)
        if state is None or not self._matcher.accept_token(token_id):
            return False
        self._states.append(state)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens, in the inner matcher and here."""
        if not 0 <= num_tokens < len(self._states):
            raise ValueError(
                f"cannot roll back {num_tokens} of {len(self._states) - 1} accepted tokens"
            )
        self._matcher.rollback(num_tokens)
        del self._states[len(self._states) - num_tokens :]

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()
