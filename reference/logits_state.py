"""What the logits stage keeps of one request between steps.

The sampling stage is a pure function of a batch's logits and per-row tensors
(`decodespec.spec.sampling.sampling_tensors`); what those tensors are built
from is per-request state that changes with every token: the output so far
(the penalties' counts, min_tokens' clock). `LogitsState` holds it, built
once when the request is added (its seed already resolved) and advanced with
each token the request emits — as the spec's loop keeps `output` beside its
stop checker (`decodespec.spec.generate.generate`).

A grammar matcher (structured outputs) belongs here too: filled into the
row's token mask before sampling, advanced by `advance` with each emitted
token, and never advanced by drafts until verification accepts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from decodespec.spec.params import SamplingParams


@dataclass
class LogitsState:
    """One request's parameters (seed resolved), prompt and output so far."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)

    def advance(self, token_id: int) -> None:
        """The request emitted `token_id`."""
        self.output_ids.append(token_id)

    def row_outputs(self, draft_tokens: Sequence[int]) -> list[list[int]]:
        """The output each logits row of a pass sees: after the request's last token,
        then after each of its drafts (the drafts so far count as output)."""
        return [self.output_ids + list(draft_tokens[:j]) for j in range(len(draft_tokens) + 1)]
