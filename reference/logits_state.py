"""What the logits stage keeps of one request between steps.

The sampling stage is a pure function of a batch's logits and per-row tensors
(`decodespec.spec.sampling.sampling_tensors`); what those tensors are built
from is per-request state that changes with every token: the output so far
(the penalties' counts, min_tokens' clock) and, for structured outputs, the
grammar's matcher (the row's token bitmask). `LogitsState` holds it, built
once when the request is added (its seed already resolved) and advanced with
each token the request emits — as the spec's loop keeps `output` and its
matcher beside its stop checker (`decodespec.spec.generate.generate`).

Drafts never advance the matcher for good (MASK-ADVANCE-1): the mask of a
row after some drafts is filled with the drafts accepted into the matcher
and rolled back at once, and a draft the grammar rejects is cut before the
pass (`grammar_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from decodespec.spec.params import SamplingParams
from decodespec.spec.token_mask import TokenMatcher


@dataclass
class LogitsState:
    """One request's parameters (seed resolved), prompt, output so far and grammar."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    matcher: TokenMatcher | None = None

    def advance(self, token_id: int) -> None:
        """The request emitted `token_id`.

        Raises:
            ValueError: the grammar does not allow it (a token the mask allowed
                always is; this fails the request rather than go on outside it).
        """
        if self.matcher is not None and not self.matcher.accept_token(token_id):
            raise ValueError(f"the grammar does not allow token {token_id} here")
        self.output_ids.append(token_id)

    def row_outputs(self, draft_tokens: Sequence[int]) -> list[list[int]]:
        """The output each logits row of a pass sees: after the request's last token,
        then after each of its drafts (the drafts so far count as output)."""
        return [self.output_ids + list(draft_tokens[:j]) for j in range(len(draft_tokens) + 1)]

    def fill_bitmask(self, bitmask: Tensor, output: Sequence[int]) -> None:
        """The grammar's mask of the token after `output` (this request's output so far,
        then drafts) into a `[words]` row; all zeros if the grammar rejects a draft."""
        assert self.matcher is not None
        extra = list(output[len(self.output_ids) :])
        accepted = 0
        try:
            for token in extra:
                if not self.matcher.accept_token(token):
                    bitmask.zero_()
                    return
                accepted += 1
            self.matcher.fill_bitmask(bitmask)
        finally:
            self.matcher.rollback(accepted)

    def grammar_prefix(self, draft_tokens: Sequence[int]) -> int:
        """How many of `draft_tokens`, from the first, the grammar allows."""
        if self.matcher is None:
            return len(draft_tokens)
        accepted = 0
        try:
            for token in draft_tokens:
                if not self.matcher.accept_token(token):
                    break
                accepted += 1
        finally:
            self.matcher.rollback(accepted)
        return accepted
