"""The sampler: the stages after the forward pass, over a batch of logits rows.

One row per position that gets a token (a request's last token, and each of
its drafts). For those rows the sampler builds the per-row tensors from each
request's `LogitsState`, then chooses tokens with the backend's stage
functions: `sample` for a request without drafts, `verify_drafts` for one
with drafts, and logprobs and candidates for the tokens chosen. Processed
logits (steps 1-8 of the sampling pipeline) are computed at most once per
pass, for every row that needs them (`PassLogits`).

Invalid rows (SAMPLE-VALID-1) come back as a reason per row (FlashInfer's
style: tokens plus a validity mask), never as an exception, so the engine
fails those requests and keeps the others.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from decodespec.spec import sampling
from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.params import SamplingTensors, sampling_tensors
from decodespec.spec.softmax import softmax
from decodespec.spec.token_mask import bitmask_words, removed_tokens

from .backend import Backend, lone_row_on_one_thread
from .logits_state import LogitsState, row_outputs
from .request import Draft, PassOutcome

# The distributions speculative decoding compares: a lone row's softmax on one thread,
# as the backend's stages (a draft's or target's row then has its bits whatever the batch).
distribution_of = lone_row_on_one_thread(softmax)

MODEL_INVALID = "the model produced NaN or infinite logits"
PROCESSORS_INVALID = (
    "the request's logit processors (logit_bias, min_tokens, penalties) "
    "turned the model's valid logits invalid (NaN, +inf or all -inf)"
)
GRAMMAR_INVALID = (
    "no token is left that the request's grammar allows (the model's logits there are "
    "-inf, or min_tokens holds back the stop token of a complete grammar)"
)


class PassLogits:
    """A pass's logits rows with their sampling tensors, and their processed logits
    computed once, on first use, for every row that any consumer will ask for."""

    def __init__(
        self, sampler: Sampler, logits: Tensor, tensors: SamplingTensors, needs: list[int]
    ) -> None:
        self.sampler = sampler
        self.logits = logits
        self.tensors = tensors
        self._needs = needs  # the rows whose processed logits will be asked for
        self._processed: dict[int, int] | None = None  # row -> index in the computed block
        self._block: Tensor | None = None
        self._reasons: list[str | None] = []

    def processed(self, rows: Sequence[int]) -> tuple[Tensor, list[str | None]]:
        """Processed logits of `rows` (each must be in `needs`), and per row None or why
        it is invalid (its processed row is then the raw row)."""
        if self._processed is None:
            needs = sorted(set(self._needs))
            self._block, self._reasons = self.sampler.process(
                self.logits[needs], self.tensors.rows(needs)
            )
            self._processed = {row: i for i, row in enumerate(needs)}
        index = [self._processed[row] for row in rows]
        return self._block[index], [self._reasons[i] for i in index]


class Sampler:
    """Chooses tokens from logits rows with a backend's stage functions."""

    def __init__(self, backend: Backend, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def tensors(
        self,
        states: Sequence[LogitsState],
        outputs: Sequence[list[int]],
        device: torch.device,
        bitmask: Tensor | None = None,
    ) -> SamplingTensors:
        """`sample`'s per-row tensors: row i has states[i]'s parameters after `outputs[i]`,
        and `bitmask[i]` as its grammar's mask (None: every row allows every token)."""
        return sampling_tensors(
            [state.params for state in states],
            vocab_size=self.vocab_size,
            prompt_token_ids=[state.prompt_ids for state in states],
            output_token_ids=list(outputs),
            eos_token_ids=self.eos_token_ids,
            device=device,
            token_bitmask=bitmask,
        )

    def choose_greedy(self, logits: Tensor) -> list[PassOutcome]:
        """`choose` for a pass of plain greedy rows (`plain_greedy`), one a request:
        each row's first argmax (SAMPLE-GREEDY-1) where it is valid (SAMPLE-VALID-1),
        without the sampling tensors. A row's maximum is finite exactly when it has no
        NaN, no +inf and a value above −inf, so it is the validity check too."""
        maxima, tokens = logits.max(dim=-1)  # the index of a row's first maximum
        valid = torch.isfinite(maxima).tolist()
        return [
            PassOutcome([token], [None], [None]) if ok else PassOutcome(error=MODEL_INVALID)
            for token, ok in zip(tokens.tolist(), valid, strict=True)
        ]

    # -- the stage functions, row by row, with invalid rows as reasons

    def sample(self, logits: Tensor, tensors: SamplingTensors) -> tuple[Tensor, list[str | None]]:
        """One token per row, and per row None or why its logits are invalid."""
        try:
            return self.backend.sample(logits, **tensors), [None] * len(logits)
        except self.backend.invalid_logits_error as error:
            return error.tokens.clamp(min=0), invalid_reasons(logits, error.rows, tensors)

    def process(self, logits: Tensor, tensors: SamplingTensors) -> tuple[Tensor, list[str | None]]:
        """The logits each row's token is drawn from (steps 1-8), and per row None or
        why it is invalid (its processed row is then the raw row)."""
        args = tensors.process_logits_args
        try:
            return self.backend.process_logits(logits, **args), [None] * len(logits)
        except self.backend.invalid_logits_error as error:
            reasons = invalid_reasons(logits, error.rows, tensors)
            good = [i for i, reason in enumerate(reasons) if reason is None]
            processed = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
            if good:
                good_args = tensors.rows(good).process_logits_args
                processed[good] = self.backend.process_logits(logits[good], **good_args)
            return processed, reasons

    def distributions(self, rows: PassLogits, at: list[int]) -> tuple[Tensor, list[str | None]]:
        """The distribution the token of each row in `at` is drawn from, and per row
        None or why it is invalid.

        A sampled row: softmax of its processed logits (steps 1-8). A greedy
        row: the point mass at the token `sample` chooses, so that speculative
        verification compares drafts with exactly plain greedy's token.
        Invalid rows are all zeros.
        """
        logits = rows.logits
        probs = logits.new_zeros(len(at), logits.shape[1])
        reasons: list[str | None] = [None] * len(at)
        greedy = (rows.tensors["temperature"][at] == 0).tolist()
        part = [j for j in range(len(at)) if greedy[j]]
        if part:
            picked = [at[j] for j in part]
            tokens, why = self.sample(logits[picked], rows.tensors.rows(picked))
            probs[part, tokens] = 1
            for j, reason in zip(part, why, strict=True):
                reasons[j] = reason
        part = [j for j in range(len(at)) if not greedy[j]]
        if part:
            processed, why = rows.processed([at[j] for j in part])
            probs[part] = distribution_of(processed).to(probs.dtype)
            for j, reason in zip(part, why, strict=True):
                reasons[j] = reason
        probs[[j for j, reason in enumerate(reasons) if reason is not None]] = 0
        return probs, reasons

    def draft_distributions(
        self,
        logits: Tensor,
        states: list[LogitsState],
        outputs: list[list[int]],
        bitmask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a model drafter: each row's distribution under its request's parameters
        after `outputs[i]` and its grammar's mask `bitmask[i]` (`distributions`), with
        the row's seed, step and validity."""
        tensors = self.tensors(states, outputs, logits.device, bitmask)
        everything = list(range(len(logits)))
        probs, reasons = self.distributions(
            PassLogits(self, logits, tensors, everything), everything
        )
        valid = torch.tensor([reason is None for reason in reasons], device=logits.device)
        return probs, tensors["seed"], tensors["step"], valid

    def verify(
        self, drafts: list[Draft], rows: PassLogits, at: list[int]
    ) -> tuple[list[list[int]], list[str | None]]:
        """Each drafted request's tokens (accepted drafts, then one more) and None, or no
        tokens and why its first row is invalid. Request i owns the rows of `at`
        after the previous requests' (one after its last token, one per draft)."""
        probs, reasons = self.distributions(rows, at)
        k = max(len(d.tokens) for d in drafts)
        vocab = probs.shape[-1]
        target = probs.new_zeros(len(drafts), k + 1, vocab)
        draft_probs = probs.new_zeros(len(drafts), k, vocab)
        draft_tokens = torch.zeros(len(drafts), k, dtype=torch.int64, device=probs.device)
        num_draft, heads, errors = [], [], []
        i0 = 0
        for i, draft in enumerate(drafts):
            n = len(draft.tokens)
            target[i, : n + 1] = probs[i0 : i0 + n + 1]
            draft_tokens[i, :n] = torch.tensor(draft.tokens, device=probs.device)
            if draft.probs is None:  # a deterministic drafter: one-hot
                draft_probs[i, torch.arange(n, device=probs.device), draft_tokens[i, :n]] = 1
            else:
                draft_probs[i, :n] = draft.probs
            # Invalid target logits after draft j − 1 end the run before it: only the
            # tokens before them are decided (none, if the first row is invalid).
            bad = [j for j in range(n + 1) if reasons[i0 + j] is not None]
            errors.append(reasons[i0] if bad and bad[0] == 0 else None)
            num_draft.append(min(n, bad[0] - 1) if bad else n)
            heads.append(at[i0])
            i0 += n + 1
        head = rows.tensors.rows(heads)
        result = self.backend.verify_drafts(
            draft_tokens,
            draft_probs,
            target,
            torch.tensor(num_draft, dtype=torch.int64, device=probs.device),
            temperature=head["temperature"],
            seed=head["seed"],
            step=head["step"],
        )
        emitted = [
            [] if errors[i] else result.tokens[i, : int(result.num_accepted[i]) + 1].tolist()
            for i in range(len(drafts))
        ]
        return emitted, errors

    def logprobs(
        self, rows: PassLogits, picked: list[int], tokens: Tensor, states: list[LogitsState]
    ) -> list[TokenLogprobs | None]:
        """Logprobs of `tokens` chosen at rows `picked`, for the rows whose request
        asked (raw by default, LOGPROB-RAW-1)."""
        result: list[TokenLogprobs | None] = [None] * len(picked)
        for mode in ("raw", "processed"):
            part = [
                j
                for j, state in enumerate(states)
                if state.params.top_logprobs is not None and state.params.logprobs_mode == mode
            ]
            if not part:
                continue
            at = [picked[j] for j in part]
            source = rows.processed(at)[0] if mode == "processed" else rows.logits[at]
            n = max(states[j].params.top_logprobs or 0 for j in part)
            lp = self.backend.compute_logprobs(source, tokens[part], n)
            bitmask = rows.tensors.token_bitmask
            for row, j in enumerate(part):
                top_n = states[j].params.top_logprobs or 0
                top = list(
                    zip(
                        lp.top_token_ids[row, :top_n].tolist(),
                        lp.top_logprobs[row, :top_n].tolist(),
                        strict=True,
                    )
                )
                removed = ()
                if bitmask is not None and states[j].matcher is not None:
                    removed = removed_tokens(bitmask[at[row]], [t for t, _ in top])
                result[j] = TokenLogprobs(
                    token_id=int(tokens[j]),
                    logprob=float(lp.token_logprobs[row]),
                    rank=int(lp.ranks[row]),
                    top=top,
                    removed=removed,
                )
        return result

    def candidates(
        self, rows: PassLogits, picked: list[int], n: int
    ) -> list[list[tuple[int, float]] | None]:
        """Top-n tokens after the filters at rows `picked`, with probabilities."""
        if not n or not picked:
            return [None] * len(picked)
        processed, _ = rows.processed(picked)
        n = min(n, processed.shape[1])
        top = self.backend.compute_logprobs(processed, processed.argmax(dim=-1), n)
        return [
            [(t, math.exp(lp)) for t, lp in zip(ids, lps, strict=True) if lp > -math.inf]
            for ids, lps in zip(top.top_token_ids.tolist(), top.top_logprobs.tolist(), strict=True)
        ]

    # -- a whole pass

    def _bitmask(self, drafts: list[Draft]) -> Tensor | None:
        """The pass's grammar masks, row by row (rows without a grammar allow every token)."""
        if all(d.bitmask is None for d in drafts):
            return None
        words = bitmask_words(self.vocab_size)
        return torch.cat(
            [
                torch.full((len(d.tokens) + 1, words), -1, dtype=torch.int32)
                if d.bitmask is None
                else d.bitmask
                for d in drafts
            ]
        )

    def choose(
        self,
        logits: Tensor,
        states: list[LogitsState],
        outputs: list[list[int]],
        drafts: list[Draft],
        show_probs: int = 0,
    ) -> list[PassOutcome]:
        """Every request's tokens from a pass's logits: request b (`states[b]`, its output
        so far `outputs[b]`) owns one row after its last token and one after each of
        `drafts[b]`, masked by `drafts[b].bitmask`; a request without drafts samples
        one token, the others verify theirs. Then the logprobs and, with `show_probs`
        > 0, the candidates of the tokens chosen."""
        if not show_probs and all(map(plain_greedy, states, outputs, drafts)):
            return self.choose_greedy(logits)
        counts = [len(d.tokens) + 1 for d in drafts]
        first = list(itertools.accumulate(counts, initial=0))
        owners = [state for state, count in zip(states, counts, strict=True) for _ in range(count)]
        rows_output = [
            row
            for output, draft in zip(outputs, drafts, strict=True)
            for row in row_outputs(output, draft.tokens)
        ]
        tensors = self.tensors(owners, rows_output, logits.device, self._bitmask(drafts))
        # The rows whose processed logits something reads: sampled rows with drafts
        # (verification), rows of processed logprobs, and every row for the candidates.
        greedy = (tensors["temperature"] == 0).tolist()
        drafted_row = [
            bool(d.tokens) for d, count in zip(drafts, counts, strict=True) for _ in range(count)
        ]
        needs = [
            row
            for row, state in enumerate(owners)
            if show_probs
            or (drafted_row[row] and not greedy[row])
            or (state.params.top_logprobs is not None and state.params.logprobs_mode == "processed")
        ]
        rows = PassLogits(self, logits, tensors, needs)

        emitted: list[list[int]] = [[] for _ in states]
        errors: list[str | None] = [None] * len(states)
        plain = [b for b, d in enumerate(drafts) if not d.tokens]
        if plain:
            at = [first[b] for b in plain]
            tokens, why = self.sample(logits[at], tensors.rows(at))
            for j, b in enumerate(plain):
                emitted[b], errors[b] = ([] if why[j] else [int(tokens[j])]), why[j]
        drafted = [b for b, d in enumerate(drafts) if d.tokens]
        if drafted:
            at = [row for b in drafted for row in range(first[b], first[b + 1])]
            tokens_of, why = self.verify([drafts[b] for b in drafted], rows, at)
            for i, b in enumerate(drafted):
                emitted[b], errors[b] = tokens_of[i], why[i]

        picked = [first[b] + i for b, tokens in enumerate(emitted) for i in range(len(tokens))]
        chosen = torch.tensor(
            [t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device
        )
        logprobs = self.logprobs(rows, picked, chosen, [owners[row] for row in picked])
        candidates = self.candidates(rows, picked, show_probs)
        ends = list(itertools.accumulate(len(tokens) for tokens in emitted))
        return [
            PassOutcome(
                tokens,
                logprobs[end - len(tokens) : end],
                candidates[end - len(tokens) : end],
                len(draft.tokens),
                error,
            )
            for tokens, end, draft, error in zip(emitted, ends, drafts, errors, strict=True)
        ]


def plain_greedy(state: LogitsState, output: list[int], draft: Draft) -> bool:
    """Whether a request's token is its raw logits' first argmax, nothing else asked:
    greedy, no drafts, no grammar, no processor that changes a logit at this step
    (no bias, min_tokens reached, no penalties: LOGITS-ORDER-1) and no logprobs."""
    p = state.params
    return (
        p.temperature == 0
        and not draft.tokens
        and draft.bitmask is None
        and not p.logit_bias
        and p.min_tokens <= len(output)
        and p.repetition_penalty == 1
        and p.frequency_penalty == 0
        and p.presence_penalty == 0
        and p.top_logprobs is None
    )


def invalid_reasons(
    logits: Tensor, bad_rows: list[int], tensors: SamplingTensors
) -> list[str | None]:
    """Why each of `bad_rows` is invalid (None for the other rows): the model's
    logits, the grammar, or the parameters that turned valid logits into invalid ones."""
    reasons: list[str | None] = [None] * len(logits)
    if not bad_rows:
        return reasons
    raw_bad = sampling.invalid_rows(logits[bad_rows].float()).tolist()
    bitmask = tensors.token_bitmask
    for row, model_fault in zip(bad_rows, raw_bad, strict=True):
        if model_fault:
            reasons[row] = MODEL_INVALID
        elif bitmask is not None and bool((bitmask[row] != -1).any()):
            reasons[row] = GRAMMAR_INVALID
        else:
            reasons[row] = PROCESSORS_INVALID
    return reasons
