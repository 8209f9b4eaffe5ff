"""The model runner: one forward pass for a batch, then the sampler on its logits.

A pass is a function of its inputs: it writes the KV cache at each request's
new positions but changes no `Request`; what it computed (the tokens, the
positions now cached, the prompt scores) comes back in each `PassOutcome`,
and the scheduler applies it.

`PagedModelRunner` runs each request's new tokens (and its drafts) through
the model over the paged KV cache; `NaiveModelRunner`, its twin without a
cache, recomputes every sequence whole. Either hands the logits to the
sampler (`sampler.py`), which chooses every request's tokens.

Prompt logprobs (`Engine.add_request(prompt_logprobs=k)`): in a pass that
runs prompt positions a request has not scored yet (`Request.prompt_positions`),
the runner also projects those positions' hidden states to logits, at most
`score_rows` rows at a time, and keeps of each row only its record: the raw
`log_softmax` score of the prompt token that follows, its rank and the top-k
(`compute_logprobs`, LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1), exactly as
the spec's `forward_naive(weights, prompt)` logits give them. A long prompt's
`[tokens, vocab]` logits are never held at once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from decodespec.spec.forward import (
    ModelWeights,
    PagedBatch,
    forward_naive,
    naive_hidden_states,
    project_logits,
)
from decodespec.spec.generate import TokenLogprobs

from .backend import Backend
from .cache import PagedKVCache
from .native_step import NativeStep, hidden_states
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
        """One forward pass over the batch (each request's scheduled tokens and drafts),
        then the tokens of every request whose pass reaches its sequence's end:
        sampled, or its drafts verified. A prompt chunk short of the end gets only
        the positions it cached (and its prompt tokens' scores)."""
        tokens = [d.tokens for d in drafts]
        positions = [_scored_in_pass(r) for r in batch]
        if any(positions):
            logits, cached, scores = self.forward_scoring(batch, tokens, positions)
        else:
            (logits, cached), scores = self.forward(batch, tokens), [[] for _ in batch]
        sampling = [i for i, r in enumerate(batch) if r.samples]
        chosen = self.sampler.choose(
            logits,
            [batch[i].logits_state for i in sampling],
            [batch[i].output_ids for i in sampling],
            [drafts[i] for i in sampling],
            show_probs,
        )
        outcomes = [PassOutcome() for _ in batch]
        for i, outcome in zip(sampling, chosen, strict=True):
            outcomes[i] = outcome
        return [
            replace(outcome, prompt_logprobs=records, num_cached=c, draft_cached=d.drafter_cached)
            for outcome, records, c, d in zip(outcomes, scores, cached, drafts, strict=True)
        ]

    def forward(
        self, batch: list[Request], drafts: list[list[int]]
    ) -> tuple[Tensor, list[int | None]]:
        """Logits after each request's last token and after each of its drafts,
        `[Σ (len(drafts[b]) + 1), vocab]` request by request (none for a request
        whose pass stops short of its sequence's end: `Request.samples`), and the
        positions each request has cached after the pass (None: no cache)."""
        raise NotImplementedError

    def forward_scoring(
        self, batch: list[Request], drafts: list[list[int]], positions: list[range]
    ) -> tuple[Tensor, list[int | None], list[list[TokenLogprobs]]]:
        """`forward`'s logits and cached positions, and for each request the scores of
        the prompt tokens after its `positions` (each must run in this pass)."""
        raise NotImplementedError

    # Prompt positions projected to logits at once: [score_rows, vocab] float32 at most.
    score_rows = 256

    def score(
        self, hidden: Tensor, rows: list[int], targets: list[int], top: int
    ) -> list[TokenLogprobs]:
        """The raw logprob, rank and top-`top` alternatives of `targets[i]` under the
        logits of `hidden[rows[i]]`, projected `score_rows` rows at a time."""
        records: list[TokenLogprobs] = []
        for i in range(0, len(rows), self.score_rows):
            logits = project_logits(hidden[rows[i : i + self.score_rows]], self.weights.output)
            wanted = torch.tensor(targets[i : i + self.score_rows], device=logits.device)
            lp = self.backend.compute_logprobs(logits, wanted, top)
            records += [
                TokenLogprobs(t, value, rank, list(zip(ids, lps, strict=True)))
                for t, value, rank, ids, lps in zip(
                    wanted.tolist(),
                    lp.token_logprobs.tolist(),
                    lp.ranks.tolist(),
                    lp.top_token_ids.tolist(),
                    lp.top_logprobs.tolist(),
                    strict=True,
                )
            ]
        return records


class PagedModelRunner(ModelRunner):
    """Runs the new tokens over the paged KV cache, writing each request's K/V from
    its `num_cached` positions on; the outcome says how many it then holds.
    `native`: the backend's native step for these weights, which runs every pass
    of up to its `max_tokens` (None: the spec's decoder with the backend's stages)."""

    def __init__(
        self,
        weights: ModelWeights,
        backend: Backend,
        sampler: Sampler,
        cache: PagedKVCache,
        native: NativeStep | None = None,
    ) -> None:
        super().__init__(weights, backend, sampler)
        self.cache = cache
        self.native = native

    def hidden_states(self, token_ids: Tensor, paged: PagedBatch) -> Tensor:
        """`cached_hidden_states` of the packed tokens: the backend's native step for
        the passes it takes, the spec's decoder with the backend's stages otherwise."""
        return hidden_states(
            self.native,
            self.weights,
            token_ids,
            paged,
            self.cache.layers,
            attention=self.backend.paged_attention,
            append=self.backend.append_kv,
        )

    def forward(
        self, batch: list[Request], drafts: list[list[int]]
    ) -> tuple[Tensor, list[int | None]]:
        token_ids, paged = self._pack(batch, drafts)
        # `forward_cached`, with the hidden states of `hidden_states`.
        hidden = self.hidden_states(token_ids, paged)
        logits = project_logits(hidden[paged.logits_indices], self.weights.output)
        return logits, paged.seq_lens.tolist()

    def forward_scoring(
        self, batch: list[Request], drafts: list[list[int]], positions: list[range]
    ) -> tuple[Tensor, list[int | None], list[list[TokenLogprobs]]]:
        token_ids, paged = self._pack(batch, drafts)
        hidden = self.hidden_states(token_ids, paged)
        logits = project_logits(hidden[paged.logits_indices], self.weights.output)
        scores = []
        starts = paged.query_start.tolist()[:-1]
        for r, start, wanted in zip(batch, starts, positions, strict=True):
            if wanted and wanted.start < r.num_cached:
                raise RuntimeError(
                    f"prompt_logprobs: position {wanted.start} came from the cache, not this pass"
                )
            rows = [start + p - r.num_cached for p in wanted]
            targets = [r.prompt_ids[p + 1] for p in wanted]
            scores.append(self.score(hidden, rows, targets, r.options.prompt_logprobs or 0))
        return logits, paged.seq_lens.tolist(), scores

    def _pack(self, batch: list[Request], drafts: list[list[int]]) -> tuple[Tensor, PagedBatch]:
        return self.cache.paged_batch(
            [r.blocks for r in batch],
            [r.num_cached for r in batch],
            [r.scheduled_tokens() + d for r, d in zip(batch, drafts, strict=True)],
            [len(d) + 1 if r.samples else 0 for r, d in zip(batch, drafts, strict=True)],
            self.weights.device,
        )


def _scored_in_pass(request: Request) -> range:
    """The prompt positions to score (`Request.prompt_positions`) that this pass runs."""
    wanted = request.prompt_positions()
    end = request.num_cached + request.num_scheduled
    return range(wanted.start, min(wanted.stop, end)) if wanted else wanted


class NaiveModelRunner(ModelRunner):
    """No KV cache: every pass recomputes every request's whole sequence (what the
    cache saves). Takes no drafts: speculation needs the cache."""

    def forward(
        self, batch: list[Request], drafts: list[list[int]]
    ) -> tuple[Tensor, list[int | None]]:
        device = self.weights.device
        logits = [
            forward_naive(
                self.weights,
                torch.tensor(r.prompt_ids + r.output_ids, device=device),
                last_only=True,
            )
            for r in batch
        ]
        return torch.cat(logits), [None] * len(batch)

    def forward_scoring(
        self, batch: list[Request], drafts: list[list[int]], positions: list[range]
    ) -> tuple[Tensor, list[int | None], list[list[TokenLogprobs]]]:
        device = self.weights.device
        logits, scores = [], []
        for r, wanted in zip(batch, positions, strict=True):
            ids = torch.tensor(r.prompt_ids + r.output_ids, device=device)
            hidden = naive_hidden_states(self.weights, ids)  # every position's
            logits.append(project_logits(hidden[-1:], self.weights.output))
            targets = [r.prompt_ids[p + 1] for p in wanted]
            scores.append(self.score(hidden, list(wanted), targets, r.options.prompt_logprobs or 0))
        return torch.cat(logits), [None] * len(batch), scores
