"""The model runner: one forward pass for a batch, and the stage functions after it.

Everything here is batched over rows (one row per position that gets a
token) and calls the backend's stage functions; invalid rows come back as a
validity mask with a reason per row (FlashInfer's style: tokens plus a mask),
so the engine handles them in one place.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decodespec.spec import sampling
from decodespec.spec.forward import ModelWeights, forward_cached, forward_naive
from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.softmax import softmax

from .backend import Backend
from .cache import PagedKVCache
from .drafters import Draft
from .request import Request

MODEL_INVALID = "the model produced NaN or infinite logits"


@dataclass
class Outcome:
    """What one pass gave one request: its tokens (with their logprobs and
    candidates) and the drafts it proposed, or the error that fails it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    candidates: list[list[tuple[int, float]] | None] = field(default_factory=list)
    drafted: int = 0
    error: str | None = None


# verify(drafts, logits, tensors, owners) -> (tokens, errors) of the drafted requests
# (`Speculator.verify`): their rows are those of `logits`, request by request.
Verify = Callable[
    [list[Draft], Tensor, dict[str, Tensor], list[Request]],
    tuple[list[list[int]], list[str | None]],
]


class ModelRunner:
    """Runs the model over the paged cache (or naively) and samples from its logits."""

    def __init__(
        self,
        weights: ModelWeights,
        backend: Backend,
        cache: PagedKVCache | None,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.weights = weights
        self.backend = backend
        self.cache = cache
        self.eos_token_ids = eos_token_ids

    def forward(self, batch: list[Request], drafts: list[list[int]]) -> Tensor:
        """Logits after each request's last token and after each of its drafts:
        `[Σ (len(drafts[b]) + 1), vocab]`, request by request."""
        device = self.weights.device
        if self.cache is None:  # naive: recompute every sequence
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
        token_ids, paged = self.cache.paged_batch(
            [r.blocks for r in batch],
            [r.num_cached for r in batch],
            [r.new_tokens() + d for r, d in zip(batch, drafts, strict=True)],
            [len(d) + 1 for d in drafts],
            device,
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

    def sampling_tensors(
        self, requests: list[Request], outputs: list[list[int]], device: torch.device
    ) -> dict[str, Tensor]:
        """`sample`'s per-row tensors: row i has requests[i]'s parameters after `outputs[i]`."""
        return sampling.sampling_tensors(
            [r.params for r in requests],
            vocab_size=self.weights.config.vocab_size,
            prompt_token_ids=[r.prompt_ids for r in requests],
            output_token_ids=outputs,
            eos_token_ids=self.eos_token_ids,
            device=device,
        )

    def sample(
        self, logits: Tensor, tensors: dict[str, Tensor], requests: list[Request]
    ) -> tuple[Tensor, list[str | None]]:
        """One token per row, and per row None or why its logits are invalid."""
        try:
            return self.backend.sample(logits, **tensors), [None] * len(logits)
        except self.backend.invalid_logits_error as error:
            return error.tokens.clamp(min=0), self._reasons(logits, error.rows, requests)

    def process(
        self, logits: Tensor, tensors: dict[str, Tensor], requests: list[Request]
    ) -> tuple[Tensor, list[str | None]]:
        """The logits each row's token is drawn from (steps 1-8), and per row None or
        why it is invalid (its processed row is then the raw row)."""
        args = {k: v for k, v in tensors.items() if k != "seed"}
        try:
            return self.backend.process_logits(logits, **args), [None] * len(logits)
        except self.backend.invalid_logits_error as error:
            reasons = self._reasons(logits, error.rows, requests)
            good = [i for i, reason in enumerate(reasons) if reason is None]
            processed = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
            if good:
                processed[good] = self.backend.process_logits(logits[good], **pick(args, good))
            return processed, reasons

    def distributions(
        self, logits: Tensor, tensors: dict[str, Tensor], requests: list[Request]
    ) -> tuple[Tensor, list[str | None]]:
        """The distribution each row's token is drawn from, and per row why it is invalid.

        A sampled row: softmax of its processed logits (steps 1-8). A greedy
        row: the point mass at the token `sample` chooses, so that speculative
        verification compares drafts with exactly plain greedy's token.
        Invalid rows are all zeros.
        """
        rows = len(logits)
        probs = logits.new_zeros(rows, logits.shape[1])
        reasons: list[str | None] = [None] * rows
        greedy = (tensors["temperature"] == 0).tolist()
        for want_greedy in (True, False):
            part = [i for i in range(rows) if greedy[i] == want_greedy]
            if not part:
                continue
            if want_greedy:
                tokens, why = self.sample(
                    logits[part], pick(tensors, part), pick_list(requests, part)
                )
                probs[part, tokens] = 1
            else:
                processed, why = self.process(
                    logits[part], pick(tensors, part), pick_list(requests, part)
                )
                probs[part] = softmax(processed).to(probs.dtype)
            for j, i in enumerate(part):
                reasons[i] = why[j]
        bad = [i for i, reason in enumerate(reasons) if reason is not None]
        probs[bad] = 0
        return probs, reasons

    def logprobs(
        self, logits: Tensor, tokens: Tensor, tensors: dict[str, Tensor], requests: list[Request]
    ) -> list[TokenLogprobs | None]:
        """Logprobs for the rows whose request asked (raw by default, LOGPROB-RAW-1)."""
        result: list[TokenLogprobs | None] = [None] * len(requests)
        for mode in ("raw", "processed"):
            rows = [
                i
                for i, r in enumerate(requests)
                if r.params.top_logprobs is not None and r.params.logprobs_mode == mode
            ]
            if not rows:
                continue
            source = logits[rows]
            if mode == "processed":
                source, _ = self.process(source, pick(tensors, rows), pick_list(requests, rows))
            n = max(requests[i].params.top_logprobs or 0 for i in rows)
            lp = self.backend.compute_logprobs(source, tokens[rows], n)
            for j, i in enumerate(rows):
                top_n = requests[i].params.top_logprobs or 0
                result[i] = TokenLogprobs(
                    token_id=int(tokens[i]),
                    logprob=float(lp.token_logprobs[j]),
                    rank=int(lp.ranks[j]),
                    top=list(
                        zip(
                            lp.top_token_ids[j, :top_n].tolist(),
                            lp.top_logprobs[j, :top_n].tolist(),
                            strict=True,
                        )
                    ),
                )
        return result

    def candidates(
        self, logits: Tensor, tensors: dict[str, Tensor], requests: list[Request], n: int
    ) -> list[list[tuple[int, float]] | None]:
        """Top-n tokens after the filters, with probabilities (`show_probs`)."""
        if not n or not len(logits):
            return [None] * len(requests)
        processed, _ = self.process(logits, tensors, requests)
        n = min(n, processed.shape[1])
        top = self.backend.compute_logprobs(processed, processed.argmax(dim=-1), n)
        return [
            [(t, math.exp(lp)) for t, lp in zip(ids, lps, strict=True) if lp > -math.inf]
            for ids, lps in zip(top.top_token_ids.tolist(), top.top_logprobs.tolist(), strict=True)
        ]

    def _reasons(
        self, logits: Tensor, bad_rows: list[int], requests: list[Request]
    ) -> list[str | None]:
        """Why each of `bad_rows` is invalid: the model's logits, or the parameters
        that turned valid logits into invalid ones."""
        reasons: list[str | None] = [None] * len(logits)
        if not bad_rows:
            return reasons
        raw_bad = sampling.invalid_rows(logits[bad_rows].float()).tolist()
        for row, model_fault in zip(bad_rows, raw_bad, strict=True):
            if model_fault:
                reasons[row] = MODEL_INVALID
            else:
                reasons[row] = (
                    "the request's logit processors (logit_bias, min_tokens, penalties) "
                    "turned the model's valid logits invalid (NaN, +inf or all -inf)"
                )
        return reasons

    def run(
        self, batch: list[Request], drafts: list[Draft], verify: Verify | None, show_probs: int = 0
    ) -> list[Outcome]:
        """One forward pass over the batch (each request's new tokens and drafts), then
        every request's tokens: sampled, or drafts verified by `verify`."""
        logits = self.forward(batch, [d.tokens for d in drafts])
        # One logits row per position that gets a token: after the last token, then
        # after each draft (each with the output so far that far, for the penalties).
        owners = [r for r, d in zip(batch, drafts, strict=True) for _ in range(len(d.tokens) + 1)]
        outputs = [
            r.output_ids + d.tokens[:j]
            for r, d in zip(batch, drafts, strict=True)
            for j in range(len(d.tokens) + 1)
        ]
        tensors = self.sampling_tensors(owners, outputs, logits.device)
        first = list(itertools.accumulate((len(d.tokens) + 1 for d in drafts), initial=0))
        emitted, errors = self._choose(batch, drafts, logits, tensors, owners, first, verify)

        rows = [first[b] + i for b, tokens in enumerate(emitted) for i in range(len(tokens))]
        row_tokens = torch.tensor(
            [t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device
        )
        row_tensors, row_requests = pick(tensors, rows), [owners[row] for row in rows]
        logprobs = self.logprobs(logits[rows], row_tokens, row_tensors, row_requests)
        candidates = self.candidates(logits[rows], row_tensors, row_requests, show_probs)
        ends = list(itertools.accumulate(len(tokens) for tokens in emitted))
        return [
            Outcome(
                tokens,
                logprobs[end - len(tokens) : end],
                candidates[end - len(tokens) : end],
                len(draft.tokens),
                error,
            )
            for tokens, end, draft, error in zip(emitted, ends, drafts, errors, strict=True)
        ]

    def _choose(
        self,
        batch: list[Request],
        drafts: list[Draft],
        logits: Tensor,
        tensors: dict[str, Tensor],
        owners: list[Request],
        first: list[int],
        verify: Verify | None,
    ) -> tuple[list[list[int]], list[str | None]]:
        """Each request's tokens, or why its logits are invalid. A request without
        drafts samples one token (`sample`); the others verify theirs. Request
        b's rows are `first[b] .. first[b + 1] − 1`."""
        emitted: list[list[int]] = [[] for _ in batch]
        errors: list[str | None] = [None] * len(batch)
        plain = [b for b, d in enumerate(drafts) if not d.tokens]
        if plain:
            rows = [first[b] for b in plain]
            tokens, why = self.sample(logits[rows], pick(tensors, rows), [batch[b] for b in plain])
            for j, b in enumerate(plain):
                emitted[b], errors[b] = ([] if why[j] else [int(tokens[j])]), why[j]
        drafted = [b for b, d in enumerate(drafts) if d.tokens]
        if drafted:
            assert verify is not None, "drafts need a verifier"
            rows = [row for b in drafted for row in range(first[b], first[b + 1])]
            tokens_of, why = verify(
                [drafts[b] for b in drafted],
                logits[rows],
                pick(tensors, rows),
                [owners[row] for row in rows],
            )
            for i, b in enumerate(drafted):
                emitted[b], errors[b] = tokens_of[i], why[i]
        return emitted, errors


def pick(tensors: dict[str, Tensor], rows: list[int]) -> dict[str, Tensor]:
    """The sampling tensors of some rows."""
    return {k: v[rows] for k, v in tensors.items()}


def pick_list(items: list, rows: list[int]) -> list:
    return [items[i] for i in rows]
