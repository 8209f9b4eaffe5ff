"""What the logits stage keeps of one request between steps, and the grammar's
whole life in the engine.

The sampling stage is a pure function of a batch's logits and per-row tensors
(`decodespec.spec.params.sampling_tensors`); what those tensors are built
from is the request's parameters (seed resolved), its prompt, its output so
far (the request's stop stage holds it: the penalties' counts, min_tokens'
clock) and, for structured outputs, the grammar's matcher. `LogitsState`
holds the parameters, the prompt and the matcher, built once when the request
is added — as the spec's loop keeps its matcher beside its stop checker
(`decodespec.spec.generate.generate`).

The matcher, top to bottom (MASK-ADVANCE-1):
- created when the request is added (`Engine.add_request`, compiled by
  `grammar.GrammarCompiler`);
- each pass, `grammar_rows` walks it along the request's drafts in one sweep:
  fill the mask after the output, then per draft accept it and fill the next
  row; the first draft the grammar rejects ends the sweep, and the drafts
  from it on are cut before verification. One rollback at the end: K drafts
  cost K accepts and K + 1 fills;
- a model drafter walks it the same way while it drafts (`walk`), so its
  draft distributions are masked too;
- `advance` moves it for good with each emitted token (`Request.emit`);
- a finished request drops it with its `LogitsState`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from decodespec.spec.params import SamplingParams
from decodespec.spec.token_mask import TokenMatcher


class GrammarWalk:
    """A matcher walked forward along drafts, then rolled back once (`LogitsState.walk`)."""

    def __init__(self, matcher: TokenMatcher) -> None:
        self.matcher = matcher
        self.accepted = 0

    def fill(self, row: Tensor) -> None:
        """The mask of the token after the output and the drafts accepted so far."""
        self.matcher.fill_bitmask(row)

    def accept(self, token_id: int) -> bool:
        """Take the next draft; False (and nothing taken) if the grammar rejects it."""
        if not self.matcher.accept_token(token_id):
            return False
        self.accepted += 1
        return True

    def rollback(self) -> None:
        if self.accepted:
            self.matcher.rollback(self.accepted)
        self.accepted = 0


@dataclass
class LogitsState:
    """One request's parameters (seed resolved), prompt and grammar."""

    params: SamplingParams
    prompt_ids: list[int]
    matcher: TokenMatcher | None = None

    def advance(self, token_id: int) -> None:
        """The request emitted `token_id`: the grammar takes it for good.

        Raises:
            ValueError: the grammar does not allow it (a token the mask allowed
                always is; this fails the request rather than go on outside it).
        """
        if self.matcher is not None and not self.matcher.accept_token(token_id):
            raise ValueError(f"the grammar does not allow token {token_id} here")

    @contextmanager
    def walk(self) -> Iterator[GrammarWalk | None]:
        """The matcher to walk along drafts (None without a grammar), rolled back on exit."""
        if self.matcher is None:
            yield None
            return
        walk = GrammarWalk(self.matcher)
        try:
            yield walk
        finally:
            walk.rollback()

    def grammar_rows(self, draft_tokens: Sequence[int], words: int) -> tuple[int, Tensor | None]:
        """How many of `draft_tokens`, from the first, the grammar allows, and the mask of
        each row a pass runs for them: `[allowed + 1, words]` int32, after the output,
        then after each allowed draft (None without a grammar). One sweep."""
        if self.matcher is None:
            return len(draft_tokens), None
        rows = torch.full((len(draft_tokens) + 1, words), -1, dtype=torch.int32)
        with self.walk() as walk:
            assert walk is not None
            walk.fill(rows[0])
            for j, token in enumerate(draft_tokens):
                if not walk.accept(token):
                    return j, rows[: j + 1]
                walk.fill(rows[j + 1])
        return len(draft_tokens), rows


def row_outputs(output_ids: Sequence[int], draft_tokens: Sequence[int]) -> list[list[int]]:
    """The output each logits row of a pass sees: after the request's last token, then
    after each of its drafts (the drafts so far count as output)."""
    return [list(output_ids) + list(draft_tokens[:j]) for j in range(len(draft_tokens) + 1)]
