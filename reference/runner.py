"""The model runner: one forward pass for a batch, then the sampler on its logits.

`PagedModelRunner` runs each request's new tokens (and its drafts) through
the model over the paged KV cache; `NaiveModelRunner`, its twin without a
cache, recomputes every sequence whole. Either hands the logits to the
sampler (`sampler.py`), which chooses every request's tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decodespec.spec.forward import ModelWeights, forward_cached, forward_naive

from .backend import Backend
from .cache import PagedKVCache
from .request import Draft, PassOutcome, Request
from .sampler import Sampler


class ModelRunner:
    """Runs the model on a batch (`forward`) and samples from its logits."""

    def __init__(self, weights: ModelWeights, backend: Backend, sampler: Sampler) -> None:
        self.weights = weights
        self.backend = backend  # its paged_attention and append_kv
        self.sampler = sampler

    def run(
        self, batch: list[Request], drafts: list[Draft], show_probs: int = 0
    ) -> list[PassOutcome]:
        """One forward pass over the batch (each request's new tokens and drafts), then
        every request's tokens: sampled, or its drafts verified."""
        logits = self.forward(batch, [d.tokens for d in drafts])
        states = [r.logits_state for r in batch]
        return self.sampler.choose(logits, states, drafts, show_probs)

    def forward(self, batch: list[Request], drafts: list[list[int]]) -> Tensor:
        """Logits after each request's last token and after each of its drafts:
        `[Σ (len(drafts[b]) + 1), vocab]`, request by request."""
        raise NotImplementedError


class PagedModelRunner(ModelRunner):
    """Runs the new tokens over the paged KV cache; a request's `num_cached` then
    counts the positions the pass wrote."""

    def __init__(
        self, weights: ModelWeights, backend: Backend, sampler: Sampler, cache: PagedKVCache
    ) -> None:
        super().__init__(weights, backend, sampler)
        self.cache = cache

    def forward(self, batch: list[Request], drafts: list[list[int]]) -> Tensor:
        token_ids, paged = self.cache.paged_batch(
            [r.blocks for r in batch],
            [r.num_cached for r in batch],
            [r.new_tokens() + d for r, d in zip(batch, drafts, strict=True)],
            [len(d) + 1 for d in drafts],
            self.weights.device,
        )
        logits = forward_cached(
            self.weights,
            token_ids,
            paged,
            self.cache.layers,
            attention=self.backend.paged_attention,
            append=self.backend.append_kv,
        )
        for r, length in zip(batch, paged.seq_lens.tolist(), strict=True):
            r.num_cached = length
        return logits


class NaiveModelRunner(ModelRunner):
    """No KV cache: every pass recomputes every request's whole sequence (what the
    cache saves). Takes no drafts: speculation needs the cache."""

    def forward(self, batch: list[Request], drafts: list[list[int]]) -> Tensor:
        device = self.weights.device
        return torch.cat(
            [
                forward_naive(
                    self.weights,
                    torch.tensor(r.prompt_ids + r.output_ids, device=device),
                    last_only=True,
                )
                for r in batch
            ]
        )
