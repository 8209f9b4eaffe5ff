"""Token mask stage: the tokens a grammar allows, applied to the logits.

Structured outputs (JSON, a regular expression, a grammar) constrain each
step to the tokens that keep the output inside the language. A grammar
matcher (xgrammar or llguidance) fills a packed bitmask per request and per
step; this stage is what the bitmask does to the logits. Filling it is the
matcher's business, not the spec's.

Layout
------
[MASK-LAYOUT-1] A bitmask is a `torch.int32` tensor of shape
`[batch, words]`: row b is the mask of logits row b, and token t is allowed
iff bit `t % 32` of word `t // 32` is 1, bit 0 being the least significant.
A word is 32 raw bits: its sign is irrelevant (−1 allows all 32 of its
tokens, 1 allows the first one only, −2³¹ the last one only). This is the
layout xgrammar and llguidance exchange (`allocate_token_bitmask` gives
`[batch, ceil(V / 32)]` int32 words filled with −1), so their bitmasks are
used as they come.

Applying it
-----------
[MASK-APPLY-1] `apply_token_bitmask` returns new logits of the input's
shape and dtype: an allowed entry is copied bit for bit (NaN and ±inf
included: judging them is SAMPLE-VALID-1's business, not this stage's), a
disallowed entry becomes −inf whatever it held, NaN included. The input
tensors are not modified.

[MASK-WIDTH-1] The vocabulary is the logits' width V. Bits of tokens t >= V
are ignored: the padding bits of the last word when V is not a multiple of
32, and whole words past `ceil(V / 32)` when the bitmask is wider than
needed. Columns t >= 32 · words of logits wider than the bitmask are
disallowed (−inf): a model whose embedding is padded past its tokenizer's
vocabulary produces logits for ids that are no token, and a grammar never
allows those. Differs from xgrammar, whose `apply_token_bitmask_inplace`
(without its `vocab_size` argument) masks the first `min(V, 32 · words)`
columns only and leaves the columns past the bitmask as they were;
llguidance's numpy `apply_token_bitmask_inplace` sets them to −inf as here.

[MASK-ROWS-1] `indices` None masks every row. Otherwise it is a 1-D integer
tensor of row numbers: only those rows are masked (row b by bitmask row b),
and every other row is returned bit for bit as it came, its bitmask row not
read: the rows of requests without a grammar in the same batch. A row named
twice is masked once (masking is idempotent); an empty `indices` masks
nothing. This is xgrammar's `indices` argument, which also indexes both the
logits and the bitmask; here the bitmask always has one row per logits row.

[MASK-EMPTY-1] A row whose mask allows no token of its vocabulary comes out
all −inf. The mask does not raise and picks no replacement token (never a
silent EOS): such a row is invalid (SAMPLE-VALID-1), and the sampling stage
reports it, so the engine fails that request alone. Masking can also make a
row valid: NaN in a disallowed position is gone.

[MASK-ORDER-1] In the sampling pipeline the mask applies first, to the raw
logits, before logit bias, min_tokens, penalties, temperature and the
filters (SEMANTICS.md, "Structured outputs"). The filters therefore choose
among allowed tokens: each keeps every maximum of its input (SAMPLE-ORDER-1),
so a row with one allowed token keeps at least one, and top-p can never leave
a row with nothing allowed. "Raw" logprobs (LOGPROB-RAW-1) stay the model's
own, unmasked; "processed" ones include the mask. Why first: masking
commutes with the processors, which act token by token (−inf stays −inf,
allowed entries are processed alike), so only the filters, which look at the
whole row, can tell the orders apart, and masking first is the one order in
which they only ever see tokens that can be emitted. Among other engines,
vLLM masks the raw logits too; SGLang masks after the penalties, which gives
the same logits; llama.cpp runs its whole chain on the unmasked logits and
masks (then runs the chain again) only when the sampled token is rejected,
so its top-p nucleus is the unmasked one: with the nucleus allowed and
disallowed mass below it, it can emit tokens mask-first removes
(tests/peers/test_mask_order.py, the Peers page).

[MASK-SAMPLE-1] `sample` and `process_logits` (`decodespec.spec.sampling`)
take an optional `token_bitmask`, `[batch, words]` int32, and apply it to
the raw logits before every other step, exactly as
`apply_token_bitmask(logits, token_bitmask)` would (MASK-ORDER-1), in the
same pass. A row without a grammar in a constrained batch has every bit set
(`ceil(V / 32)` words of −1), so it samples as it would unmasked; None masks
no row. A disallowed token stays −inf through the processors: bias adds a
finite value, min_tokens adds −inf, and the penalties scale or shift it by
finite amounts.

[MASK-MINTOK-1] min_tokens still holds the stop tokens back under a grammar.
When the grammar is complete and allows only stop tokens while the request
is shorter than min_tokens, nothing is left: the row is invalid
(SAMPLE-VALID-1) and the request fails with an error, never a token outside
the grammar and never a silent EOS. A grammar that allows more tokens after a
complete string (trailing whitespace) goes on with those.

[MASK-MATCHER-1] A request's grammar is a matcher (`TokenMatcher`):
`fill_bitmask` writes the mask of the request's next token, `accept_token`
advances it by a token (False, and no change, for a token it does not
allow), and `rollback(n)` undoes the last n accepted tokens. Its stop tokens
(the model's EOS ids) are allowed exactly when the output so far is a
complete string of the language; accepting one terminates the matcher, which
then allows nothing.

[MASK-ADVANCE-1] A constrained request's matcher advances with every token
the request emits and only with those. A speculative draft is accepted into
the matcher to fill the masks of the rows after it, and rolled back before
the tokens are chosen; a draft token the matcher rejects is cut from the
draft, with every draft token after it, before verification (the target's
masked distribution gives such a token probability 0, so verification would
reject it anyway: cutting a deterministic draft there changes no
distribution, and a model drafter draws its drafts from masked distributions,
which never leave the grammar). The finish reason is the stop checker's:
"stop" when the grammar's stop token is emitted (or a user stop fires
first), "length" when max_tokens or the context runs out before the grammar
is complete; the output is then the partial text, which is no complete
string of the language.

Grammars from JSON Schema
-------------------------
[MASK-SOUND-1] Soundness before coverage: every string that a grammar
compiled from a JSON Schema admits, up to its stop token, validates against
that schema (Draft 2020-12, with format assertions). A schema that uses a
keyword the grammar library would enforce only in part, or not at all (a
library that drops `maxLength` beside `pattern` with a warning, reads `oneOf`
as `anyOf`, or checks a `date` format without leap years), is refused before
any model work with an error naming the keyword and its JSON pointer
(`'maxLength' at /properties/username`): never an answer that finishes
"stop" and breaks its schema. A grammar may admit fewer strings than its
schema (a fixed property order, bounded whitespace, no leap seconds): what it
covers is measured (the JSON Schema Test Suite, JSONSchemaBench), not
promised.

[MASK-JSON-1] JSON layout: wherever JSON allows whitespace (around
structural characters), a JSON grammar allows a run of at most a bounded
number of whitespace characters (the engine's `MAX_JSON_WHITESPACE`), so a
model can lay an object out on lines, as it learned, but cannot spend its
`max_tokens` on blank lines; elsewhere the text is JSON's own.

[MASK-KEYS-1] JSON output never repeats a key within one object: a token
that would complete a key the same object already has is disallowed, keys
compared after unescaping (`"a"` and `"\\u0061"` are one key); nested objects
have keys of their own. A context-free grammar cannot say this, so the
engine's matcher tracks the keys beside the grammar. Parsers disagree on
duplicate keys (the first wins, the last wins, an error), and OpenAI's JSON
mode never emits them.

[MASK-VALID-1] Invalid arguments raise `ValueError` naming the argument:
`logits` `[batch, vocab]` with a floating-point dtype and at least one
column (SAMPLE-VALID-3); `bitmask` 2-D `[batch, words]` with logits' batch,
at least one word, dtype int32 (not uint32 nor int64: a word is 32 bits,
whatever else would need a conversion the caller must choose); `indices`
None or a 1-D int32/int64 tensor whose entries are in `[0, batch)`; every
tensor on logits' device. An argument that is not a `torch.Tensor` raises
`TypeError` naming it (`ArgumentTypeError`, SOFTMAX-VALID-1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from .softmax import check_tensor, check_vocabulary

INDEX_DTYPES = (torch.int32, torch.int64)


def bitmask_words(vocab_size: int) -> int:
    """The number of int32 words of a bitmask over `vocab_size` tokens: `ceil(V / 32)`.

    Example:
        >>> bitmask_words(32), bitmask_words(33), bitmask_words(49152)
        (1, 2, 1536)
    """
    return (vocab_size + 31) // 32


def allowed_token_mask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """`[batch, vocab_size]` bool: True where the bitmask allows the token (MASK-LAYOUT-1).

    Tokens past the bitmask's `32 · words` are not allowed; bits past
    `vocab_size` are ignored (MASK-WIDTH-1).

    Args:
        bitmask: `[batch, words]` int32.
        vocab_size: the number of tokens, >= 0.

    Example:
        Word 5 = 0b101 allows tokens 0 and 2; word −1 allows all 32 of its tokens;
        token 40 lies past the single word of the second row.

        >>> allowed_token_mask(torch.tensor([[5], [-1]], dtype=torch.int32), 3)
        tensor([[ True, False,  True],
                [ True,  True,  True]])
        >>> allowed_token_mask(torch.tensor([[-1]], dtype=torch.int32), 41)[0, 30:].tolist()
        [True, True, False, False, False, False, False, False, False, False, False]
    """
    batch, words = bitmask.shape
    bit = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    # [batch, words, 32]: bit i of word w is token 32·w + i. An arithmetic right shift
    # of a negative word fills with ones, but `& 1` keeps bit i alone.
    bits = (bitmask[:, :, None] >> bit) & 1 == 1
    allowed = bits.reshape(batch, 32 * words)[:, :vocab_size]
    if allowed.shape[1] < vocab_size:  # logits wider than the bitmask
        missing = torch.zeros(batch, vocab_size - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, missing.to(bitmask.device)], dim=1)
    return allowed


def check_bitmask(logits: Tensor, bitmask: Tensor, name: str = "bitmask") -> None:
    """MASK-VALID-1 for `logits` `[batch, vocab]` and its `bitmask` `[batch, words]`."""
    check_tensor("logits", logits)
    check_tensor(name, bitmask)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must have a floating-point dtype, got {logits.dtype}")
    check_vocabulary("logits", logits)
    batch = logits.shape[0]
    if bitmask.dim() != 2 or bitmask.shape[0] != batch or bitmask.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape [{batch}, words] (logits' batch, words >= 1), "
            f"got {list(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (32 tokens a word), got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"{name} is on {bitmask.device}, logits on {logits.device}")


def removed_tokens(bitmask_row: Tensor, token_ids: Iterable[int]) -> tuple[int, ...]:
    """Those of `token_ids` that a `[words]` bitmask row disallows (MASK-LAYOUT-1).

    Example:
        >>> removed_tokens(torch.tensor([0b101], dtype=torch.int32), [0, 1, 2, 40])
        (1, 40)
    """
    words = bitmask_row.shape[0]
    return tuple(
        t for t in token_ids if t >= 32 * words or not (int(bitmask_row[t // 32]) >> (t % 32)) & 1
    )


def _check_indices(indices: Tensor, batch: int, device: torch.device) -> None:
    """MASK-VALID-1 for `indices`."""
    check_tensor("indices", indices)
    if indices.dim() != 1 or indices.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"indices must be a 1-D int32 or int64 tensor of rows, got shape "
            f"{list(indices.shape)} and {indices.dtype}"
        )
    if indices.device != device:
        raise ValueError(f"indices is on {indices.device}, logits on {device}")
    outside = (indices < 0) | (indices >= batch)
    if bool(outside.any()):
        bad = int(indices[outside][0])
        raise ValueError(f"indices holds {bad}: rows must be in [0, {batch}) (logits' batch)")


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None) -> Tensor:
    """The logits with every token the bitmask disallows at −inf.

    (MASK-LAYOUT-1, MASK-APPLY-1, MASK-WIDTH-1, MASK-ROWS-1, MASK-EMPTY-1,
    MASK-VALID-1.)

    Args:
        logits: `[batch, vocab]`, any floating dtype; not modified.
        bitmask: `[batch, words]` int32; token t of row b is allowed iff bit
            `t % 32` of `bitmask[b, t // 32]` is 1. Any `words >= 1`: tokens
            past `32 · words` are disallowed, bits past `vocab` ignored.
        indices: optional `[n]` int32/int64 rows to mask; the other rows are
            returned unchanged. None masks every row.

    Returns:
        `[batch, vocab]`, logits' dtype: allowed entries bit for bit as they
        were, disallowed ones −inf.

    Raises:
        ValueError: a wrong shape, dtype, device or row (MASK-VALID-1); the
            message names the argument.
        TypeError: an argument that is not a tensor (MASK-VALID-1).

    Example:
        Row 0 allows tokens 0 and 2 (word 0b101); row 1 is not in `indices`, so
        it keeps everything, NaN included.

        >>> logits = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("nan"), 6.0]])
        >>> bitmask = torch.tensor([[0b101], [0]], dtype=torch.int32)
        >>> apply_token_bitmask(logits, bitmask, indices=torch.tensor([0]))
        tensor([[1., -inf, nan],
                [4., nan, 6.]])
        >>> apply_token_bitmask(logits, bitmask)
        tensor([[1., -inf, nan],
                [-inf, -inf, -inf]])
    """
    if indices is not None:
        check_tensor("indices", indices)
    check_bitmask(logits, bitmask)
    batch, vocab = logits.shape
    if indices is not None:
        _check_indices(indices, batch, logits.device)
    rows = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    if indices is None:
        rows[:] = True
    else:
        rows[indices.to(torch.int64)] = True
    allowed = allowed_token_mask(bitmask, vocab) | ~rows[:, None]
    return logits.masked_fill(~allowed, -math.inf)


# ---------------------------------------------------------------------------
# Matchers


class TokenMatcher(Protocol):
    """A request's grammar, token by token (MASK-MATCHER-1).

    The engine's matchers wrap a grammar library (xgrammar); `ChoiceMatcher`
    is the spec's own, small enough to read.
    """

    def fill_bitmask(self, bitmask: Tensor) -> None:
        """Write the allowed next tokens into `bitmask`, one `[words]` int32 row."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (and no change) if the grammar disallows it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""


class ChoiceMatcher:
    """The language of a few token sequences, each ended by a stop token (MASK-MATCHER-1).

    The next tokens allowed are those that continue some choice; a stop token
    is allowed once the output is a whole choice, and accepting it
    terminates the matcher.

    Example:
        >>> matcher = ChoiceMatcher([[5, 6], [5]], stop_token_ids=[0], vocab_size=8)
        >>> row = torch.zeros(1, dtype=torch.int32)
        >>> matcher.fill_bitmask(row); allowed_token_mask(row[None], 8)[0].nonzero().flatten()
        tensor([5])
        >>> matcher.accept_token(5), matcher.accept_token(7)
        (True, False)
        >>> matcher.fill_bitmask(row); allowed_token_mask(row[None], 8)[0].nonzero().flatten()
        tensor([0, 6])
    """

    def __init__(
        self, choices: Iterable[Sequence[int]], stop_token_ids: Iterable[int], vocab_size: int
    ) -> None:
        self.choices = [tuple(int(t) for t in choice) for choice in choices]
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.vocab_size = vocab_size
        self.accepted: list[int] = []
        self._terminated = False

    def _allowed(self) -> set[int]:
        if self._terminated:
            return set()
        n = len(self.accepted)
        prefix = tuple(self.accepted)
        allowed = {c[n] for c in self.choices if len(c) > n and c[:n] == prefix}
        if prefix in self.choices:
            allowed |= self.stop_token_ids
        return allowed

    def fill_bitmask(self, bitmask: Tensor) -> None:
        words = torch.zeros(bitmask.shape[-1], dtype=torch.int64)
        for token in self._allowed():
            words[token // 32] |= 1 << (token % 32)
        # int32 words are raw bits (MASK-LAYOUT-1): bit 31 is the sign bit.
        bitmask.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))

    def accept_token(self, token_id: int) -> bool:
        if token_id not in self._allowed():
            return False
        self.accepted.append(token_id)
        self._terminated = token_id in self.stop_token_ids
        return True

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self.accepted):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.accepted)} tokens")
        del self.accepted[len(self.accepted) - num_tokens :]
        self._terminated = bool(self.accepted) and self.accepted[-1] in self.stop_token_ids

    def is_terminated(self) -> bool:
        return self._terminated
