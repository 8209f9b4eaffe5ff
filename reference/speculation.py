"""Speculative decoding in the engine: drafting, verification, and what it leaves behind.

Before a pass, the drafter proposes up to K tokens per request
(`Speculator.draft`); the pass runs them through the target with the
request's last token; `Speculator.verify` keeps the prefix `verify_drafts`
accepts plus the token after it. The engine then gives back the blocks of
the rejected drafts (`Scheduler.shrink`). The emitted tokens are distributed
exactly as without speculation (greedy: identical), only faster when the
drafts are good.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from decodespec.spec.forward import ModelConfig, ModelWeights

from .backend import Backend
from .cache import PagedKVCache
from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from .request import Request
from .runner import ModelRunner, pick

# The longest a request goes without drafts after passes that accepted none.
MAX_DRAFT_PAUSE = 16


def make_drafter(
    speculate: str,
    weights: ModelWeights,
    cache: PagedKVCache | None,
    backend: Backend,
    draft_model: ModelWeights | None,
) -> Drafter:
    """The drafter `speculate` names: "ngram", "layers:N" or "model" (`draft_model`)."""
    if not isinstance(speculate, str):
        raise TypeError(f"speculate must be a string or None, got {speculate!r}")
    if cache is None:
        raise ValueError("speculative decoding needs the KV cache: it cannot run with naive=True")
    ops = {"attention": backend.paged_attention, "append": backend.append_kv}
    if speculate == "ngram":
        return NgramDrafter()
    if speculate.startswith("layers:"):
        count = speculate.removeprefix("layers:")
        if not count.isdigit():
            raise ValueError(f"speculate {speculate!r}: N of layers:N must be an integer")
        return ModelDrafter.first_layers(weights, cache, int(count), **ops)
    if speculate == "model":
        if draft_model is None:
            raise ValueError("speculate='model' needs draft_model")
        return ModelDrafter.second_model(draft_model, weights, cache, **ops)
    raise ValueError(f"unknown speculate {speculate!r}: choose ngram, layers:N or model")


class Speculator:
    """Drafts for a batch and verifies them against the target's logits."""

    def __init__(
        self,
        drafter: Drafter,
        num_draft: int,
        config: ModelConfig,
        grow: Callable[[Request, int], bool],
        runner: ModelRunner,
    ) -> None:
        self.drafter = drafter
        self.num_draft = num_draft
        self.config = config
        self.grow = grow  # Scheduler.grow: blocks for the drafts, if the pool has them
        self.runner = runner

    def draft(self, batch: list[Request]) -> list[Draft]:
        """The drafter's tokens for each request: at most K, what max_tokens and the
        context leave room for (the token after the drafts always comes too), and
        none for a request whose blocks cannot grow to hold them."""
        counts = []
        for r in batch:
            if r.draft_pause > 0:
                r.draft_pause -= 1
                counts.append(0)
                continue
            limit = self.num_draft if r.num_draft is None else r.num_draft
            count = min(limit, self.config.max_context - r.length - 1)
            if r.params.max_tokens is not None:
                count = min(count, r.params.max_tokens - len(r.output_ids) - 1)
            if count > 0 and not self.grow(r, r.length + count):
                count = 0  # no room for drafts: this step is plain decoding
            counts.append(max(count, 0))
        return self.drafter.propose(batch, counts, self.distributions)

    def distributions(
        self, logits: Tensor, requests: list[Request], outputs: list[list[int]]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a drafter: probabilities, seeds, steps and validity of each row."""
        tensors = self.runner.sampling_tensors(requests, outputs, logits.device)
        probs, reasons = self.runner.distributions(logits, tensors, requests)
        valid = torch.tensor([reason is None for reason in reasons], device=logits.device)
        return probs, tensors["seed"], tensors["step"], valid

    def verify(
        self,
        drafts: list[Draft],
        logits: Tensor,
        tensors: dict[str, Tensor],
        owners: list[Request],
    ) -> tuple[list[list[int]], list[str | None]]:
        """Each drafted request's tokens (accepted drafts, then one more) and None, or
        no tokens and why its first row is invalid. Request b owns the rows
        after the previous requests' (one after its last token, one per draft)."""
        probs, reasons = self.runner.distributions(logits, tensors, owners)
        k = max(len(d.tokens) for d in drafts)
        vocab = probs.shape[-1]
        target = probs.new_zeros(len(drafts), k + 1, vocab)
        draft_probs = probs.new_zeros(len(drafts), k, vocab)
        draft_tokens = torch.zeros(len(drafts), k, dtype=torch.int64, device=probs.device)
        num_draft, heads, errors = [], [], []
        at = 0
        for i, draft in enumerate(drafts):
            n = len(draft.tokens)
            target[i, : n + 1] = probs[at : at + n + 1]
            draft_tokens[i, :n] = torch.tensor(draft.tokens, device=probs.device)
            if draft.probs is None:  # a deterministic drafter: one-hot
                draft_probs[i, torch.arange(n, device=probs.device), draft_tokens[i, :n]] = 1
            else:
                draft_probs[i, :n] = draft.probs
            # Invalid target logits after draft j − 1 end the run before it: only the
            # tokens before them are decided (none, if the first row is invalid).
            bad = [j for j in range(n + 1) if reasons[at + j] is not None]
            errors.append(reasons[at] if bad and bad[0] == 0 else None)
            num_draft.append(min(n, bad[0] - 1) if bad else n)
            heads.append(at)
            at += n + 1
        result = self.runner.backend.verify_drafts(
            draft_tokens,
            draft_probs,
            target,
            torch.tensor(num_draft, dtype=torch.int64, device=probs.device),
            **{
                k: v
                for k, v in pick(tensors, heads).items()
                if k in ("temperature", "seed", "step")
            },
        )
        emitted = [
            [] if errors[i] else result.tokens[i, : int(result.num_accepted[i]) + 1].tolist()
            for i in range(len(drafts))
        ]
        return emitted, errors

    @staticmethod
    def record(request: Request, drafted: int, accepted: int) -> None:
        """Count a verification pass's drafts, and draft less while drafts fail.

        A verification pass costs more than a plain step (it runs K + 1
        tokens), so one that accepts nothing is a loss. After such a pass the
        request pauses drafting, twice as long as after the previous one (up
        to MAX_DRAFT_PAUSE steps); each pass that accepts a draft halves the
        pause. The drafting policy only looks at past passes, so the tokens
        keep the target's distribution."""
        request.drafted += drafted
        request.accepted += accepted
        if accepted == 0:
            request.draft_backoff = min(max(1, 2 * request.draft_backoff), MAX_DRAFT_PAUSE)
            request.draft_pause = request.draft_backoff
        else:
            request.draft_backoff //= 2
