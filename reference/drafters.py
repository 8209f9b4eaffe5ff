"""Drafters for speculative decoding: cheap guesses at a request's next tokens.

A drafter proposes up to K tokens per request, with the distribution each
was drawn from; the target model verifies them in one pass
(`decodespec.spec.speculative.verify_drafts`), so a drafter changes the speed of
generation, never its distribution. Three kinds:

- prompt lookup (`NgramDrafter`, `ngram_draft`): copy what followed the
  latest earlier occurrence of the sequence's suffix; no model, one-hot drafts;
- self-speculation (`ModelDrafter.first_layers`): the target's first N layers,
  then its own final norm and output projection; it reads and writes the
  target's cache for those layers, which verification then overwrites with
  the same values;
- a second, smaller model with the target's vocabulary (`ModelDrafter.second_model`),
  with a cache of its own addressed by the same block ids.

A model drafter samples its tokens from its own distributions under the
request's parameters (greedy rows draft greedily) with Gumbel-max on the
request's Philox stream `DRAFT_STREAM`, which no other stage uses: the
drafts are independent of the numbers verification draws, as the proof of
speculative sampling requires.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor

from decodespec.spec.forward import ModelWeights, project_logits
from decodespec.spec.rng import uniform
from decodespec.spec.sampling import greedy
from decodespec.spec.token_mask import bitmask_words

from .backend import Backend
from .cache import PagedKVCache
from .logits_state import GrammarWalk
from .native_step import NativeStep, hidden_states
from .request import Draft, Request
from .sampler import Sampler

DRAFT_STREAM = 3  # streams 0-2 are token choice, acceptance and residual (spec.speculative)


def ngram_draft(
    tokens: Sequence[int], num_draft: int, *, max_ngram: int = 3, min_ngram: int = 1
) -> list[int]:
    """Prompt lookup: continue the sequence the way it continued before.

    The longest suffix of `tokens` (from `max_ngram` tokens down to
    `min_ngram`) that also occurs earlier in `tokens` is looked up; the draft
    is the up to `num_draft` tokens that followed its latest earlier
    occurrence. Deterministic: its draft distributions are one-hot. Works
    best on output that repeats its input (summaries, code edits, quotes).

    Args:
        tokens: the prompt and the output so far.
        num_draft: K >= 0, the most tokens to propose.
        max_ngram: longest suffix tried, >= min_ngram.
        min_ngram: shortest suffix tried, >= 1.

    Returns:
        Between 0 and `num_draft` token ids (none when no suffix recurs).

    Example:
        >>> ngram_draft([5, 6, 7, 8, 1, 5, 6], 3)
        [7, 8, 1]
    """
    if num_draft < 0:
        raise ValueError(f"num_draft must be >= 0, got {num_draft}")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
    tokens = list(tokens)
    if num_draft == 0:
        return []
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # Latest earlier occurrence first: recent context predicts best. An occurrence
        # ends before the suffix itself, so at least one token follows it.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_draft]
    return []


class Drafter(Protocol):
    def propose(self, requests: list[Request], counts: list[int]) -> list[Draft]:
        """Up to `counts[i]` tokens for `requests[i]`, which has room in its blocks for them."""
        ...


class NgramDrafter:
    """Prompt lookup over the prompt and the output so far (`ngram_draft`)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        ngram_draft([], 0, max_ngram=max_ngram, min_ngram=min_ngram)  # validates
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, requests: list[Request], counts: list[int]) -> list[Draft]:
        return [
            Draft(
                ngram_draft(
                    r.prompt_ids + r.output_ids,
                    count,
                    max_ngram=self.max_ngram,
                    min_ngram=self.min_ngram,
                )
            )
            for r, count in zip(requests, counts, strict=True)
        ]


class ModelDrafter:
    """Drafts by running a cheaper model autoregressively over the paged cache.

    Its cache layers are addressed by the request's blocks (the target's
    block ids). `shares_target_cache` says they are the target's own first
    layers: then every position the target has cached is valid for the
    drafter too. Otherwise `request.draft_cached` counts the positions the
    drafter itself has cached: `propose` reads it and returns the new count
    (`Draft.drafter_cached`), which the scheduler applies with the pass's
    outcome and lowers when a rollback discards positions.
    """

    def __init__(
        self,
        weights: ModelWeights,
        kv_cache: list[tuple[Tensor, Tensor]],
        cache: PagedKVCache,
        sampler: Sampler,
        *,
        shares_target_cache: bool,
        attention: Callable[..., Tensor],
        append: Callable[..., None],
        native: Callable[[ModelWeights], NativeStep | None] = lambda weights: None,
    ) -> None:
        self.weights = weights
        # The backend's native step for these weights where it has one (the target's
        # passes run on it too): a draft row's bits are then its own, whatever the batch.
        self.native = native(weights)
        self.kv_cache = kv_cache
        self.cache = cache
        self.sampler = sampler  # the target's: drafts follow each request's parameters
        self.shares_target_cache = shares_target_cache
        self.attention = attention
        self.append = append

    @classmethod
    def first_layers(
        cls,
        target: ModelWeights,
        cache: PagedKVCache,
        sampler: Sampler,
        num_layers: int,
        **ops: Callable,
    ) -> ModelDrafter:
        """Self-speculation: the target's first `num_layers` layers and its own head."""
        total = target.config.num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(
                f"layers:N needs 1 <= N <= {total} (the model's layers), got {num_layers}"
            )
        weights = replace(
            target,
            config=replace(target.config, num_layers=num_layers),
            layers=target.layers[:num_layers],
        )
        layers = cache.layers[:num_layers]
        return cls(weights, layers, cache, sampler, shares_target_cache=True, **ops)

    @classmethod
    def second_model(
        cls,
        draft: ModelWeights,
        target: ModelWeights,
        cache: PagedKVCache,
        sampler: Sampler,
        **ops: Callable,
    ) -> ModelDrafter:
        """A smaller model of the same vocabulary, with a cache of its own (same block ids)."""
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the "
                f"target's {target.config.vocab_size}: they must share one vocabulary"
            )
        draft = draft.to(target.device)
        own = PagedKVCache(
            draft.config,
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            dtype=draft.dtype,
            device=draft.device,
        )
        return cls(draft, own.layers, own, sampler, shares_target_cache=False, **ops)

    def propose(self, requests: list[Request], counts: list[int]) -> list[Draft]:
        """Sample up to `counts[i]` tokens for each request, one batched forward per draft.
        A request's grammar is walked along its drafts as they are drawn (each draft
        distribution is masked), and rolled back when drafting ends."""
        with ExitStack() as stack:
            walks = [stack.enter_context(r.logits_state.walk()) for r in requests]
            return self._draft(requests, counts, walks)

    def _draft(
        self, requests: list[Request], counts: list[int], walks: list[GrammarWalk | None]
    ) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[Tensor]] = [[] for _ in requests]
        # Positions of each sequence whose K/V this drafter's layers hold.
        cached = [r.num_cached if self.shares_target_cache else r.draft_cached for r in requests]
        live = [i for i, count in enumerate(counts) if count > 0]
        words = bitmask_words(self.weights.config.vocab_size)
        while live:
            batch = [requests[i] for i in live]
            # What the drafter has not cached yet: the last token (or the prompt, or
            # what a rollback discarded) at first, then the previous draft.
            starts = [cached[i] for i in live]
            new = [
                (r.prompt_ids + r.output_ids + tokens[i])[cached[i] :]
                for i, r in zip(live, batch, strict=True)
            ]
            token_ids, paged = self.cache.paged_batch(
                [r.blocks for r in batch], starts, new, [1] * len(batch), self.weights.device
            )
            hidden = hidden_states(
                self.native,
                self.weights,
                token_ids,
                paged,
                self.kv_cache,
                attention=self.attention,
                append=self.append,
            )
            logits = project_logits(hidden[paged.logits_indices], self.weights.output)
            bitmask = None
            if any(walks[i] is not None for i in live):
                bitmask = torch.full((len(live), words), -1, dtype=torch.int32)
                for row, i in enumerate(live):
                    if walks[i] is not None:
                        walks[i].fill(bitmask[row])
            q, seed, step, valid = self.sampler.draft_distributions(
                logits,
                [r.logits_state for r in batch],
                [r.output_ids + tokens[i] for i, r in zip(live, batch, strict=True)],
                bitmask,
            )
            noise = -(
                -uniform(seed, step, q.shape[-1], stream=DRAFT_STREAM, dtype=q.dtype).log()
            ).log()
            drawn = greedy(q.log() + noise).tolist()  # one-hot q (greedy rows): its argmax
            still = []
            for row, i in enumerate(live):
                cached[i] = starts[row] + len(new[row])
                if not bool(valid[row]):
                    continue  # NaN or infinite draft logits (or none allowed): it ends here
                if walks[i] is not None and not walks[i].accept(drawn[row]):
                    continue  # the mask allowed it, the grammar did not: it ends here
                tokens[i].append(drawn[row])
                probs[i].append(q[row])
                if len(tokens[i]) < counts[i]:
                    still.append(i)
            live = still
        own = not self.shares_target_cache
        return [
            Draft(t, torch.stack(p) if p else None, drafter_cached=c if own else None)
            for t, p, c in zip(tokens, probs, cached, strict=True)
        ]


def make_drafter(
    speculate: str,
    weights: ModelWeights,
    cache: PagedKVCache | None,
    backend: Backend,
    sampler: Sampler,
    draft_model: ModelWeights | None,
) -> Drafter:
    """The drafter `speculate` names: "ngram", "layers:N" or "model" (`draft_model`)."""
    if not isinstance(speculate, str):
        raise TypeError(f"speculate must be a string or None, got {speculate!r}")
    if cache is None:
        raise ValueError("speculative decoding needs the KV cache: it cannot run with naive=True")
    ops = {"attention": backend.paged_attention, "append": backend.append_kv,
           "native": backend.native_step}  # fmt: skip
    if speculate == "ngram":
        return NgramDrafter()
    if speculate.startswith("layers:"):
        count = speculate.removeprefix("layers:")
        if not count.isdigit():
            raise ValueError(f"speculate {speculate!r}: N of layers:N must be an integer")
        return ModelDrafter.first_layers(weights, cache, sampler, int(count), **ops)
    if speculate == "model":
        if draft_model is None:
            raise ValueError("speculate='model' needs draft_model")
        return ModelDrafter.second_model(draft_model, weights, cache, sampler, **ops)
    raise ValueError(f"unknown speculate {speculate!r}: choose ngram, layers:N or model")
