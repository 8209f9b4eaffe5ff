"""The engine: the decode loop over the spec's stages, with continuous batching.

One `step()` runs one forward pass for every running request — the whole
prompt of a request that just joined (prefill), one token for the others
(decode) — samples one token per request, checks stop conditions, and
returns an event per request. Requests join and leave between steps. The
stage functions are the spec's or, with the `triton` backend, the kernels'
(same names, same signatures); the engine code is the same for both.

With `naive=True` there is no KV cache: every step recomputes every request's
whole sequence (`forward_naive`), which is what the cache saves.

With a drafter (`speculate=`), a step first asks it for up to `num_draft`
tokens per request, runs them through the target in the same forward pass
(attention with q_len > 1), keeps the prefix `verify_drafts` accepts plus the
token after it, and rolls the cache back past the rejected drafts: the
emitted tokens are distributed exactly as without speculation (greedy:
identical), only faster when the drafts are good.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decodespec.spec import append, attention, sampling, speculative
from decodespec.spec.forward import ModelWeights, forward_cached, forward_naive
from decodespec.spec.sampling import InvalidLogitsError, SamplingParams
from decodespec.spec.softmax import softmax
from decodespec.spec.stop import StopChecker

from .cache import CacheFullError, PagedKVCache
from .drafters import Draft, Drafter, ModelDrafter, NgramDrafter

# ---------------------------------------------------------------- backends


# The longest a request goes without drafts after passes that accepted none.
MAX_DRAFT_PAUSE = 16

STAGE_OPERATIONS = (
    "paged_attention",
    "append_kv",
    "sample",
    "process_logits",
    "compute_logprobs",
    "verify_drafts",
)


@dataclass(frozen=True)
class Backend:
    """The stage functions the engine calls (spec and kernels share their signatures).

    `kernel_ops` names the stages that run as Triton kernels; the others run
    the spec's PyTorch. `invalid_logits_error` is the class `sample` raises
    for invalid rows (SAMPLE-VALID-2: each implementation has its own).
    """

    name: str
    paged_attention: Callable[..., Tensor]
    append_kv: Callable[..., None]
    sample: Callable[..., Tensor]
    process_logits: Callable[..., Tensor]
    compute_logprobs: Callable[..., sampling.Logprobs]
    verify_drafts: Callable[..., speculative.Verification]
    invalid_logits_error: type[ValueError] = InvalidLogitsError
    kernel_ops: tuple[str, ...] = ()


SPEC_BACKEND = Backend(
    "spec",
    attention.paged_attention,
    append.append_kv,
    sampling.sample,
    sampling.process_logits,
    sampling.compute_logprobs,
    speculative.verify_drafts,
)


def get_backend(name: str) -> Backend:
    """`spec` (plain PyTorch) or `triton` (the kernels; the interpreter without a GPU).

    The triton backend takes every stage `kernels` provides and the spec's
    function for any it lacks (a partial vendored copy, say): they share the
    signatures. Without a CUDA device it selects the Triton interpreter,
    which has to happen before `kernels` is first imported.
    """
    if name == "spec":
        return SPEC_BACKEND
    if name != "triton":
        raise ValueError(f"unknown backend {name!r}: choose 'spec' or 'triton'")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = importlib.import_module("decodespec.kernels")
    provided = tuple(op for op in STAGE_OPERATIONS if hasattr(kernels, op))
    functions = {
        op: getattr(kernels if op in provided else SPEC_BACKEND, op) for op in STAGE_OPERATIONS
    }
    error = kernels.InvalidLogitsError if "sample" in provided else InvalidLogitsError
    return Backend("triton", **functions, invalid_logits_error=error, kernel_ops=provided)


def check_backend_device(backend: Backend, device: torch.device) -> None:
    """Raise ValueError unless the backend's kernels can run on tensors on `device`."""
    if not backend.kernel_ops or device.type != "cpu":
        return
    if not importlib.import_module("decodespec.kernels.checks").INTERPRET:
        raise ValueError(
            "the triton backend needs the model on a GPU (device 'cuda'), or the Triton "
            "interpreter (TRITON_INTERPRET=1) for a model on the CPU"
        )


# ---------------------------------------------------------------- requests and events


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob, rank and top alternatives of one generated token (LOGPROB-*)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class Event:
    """What one step produced for one request.

    `token_id` is None only for an error event. `text` is the text newly safe
    to show (streaming hold-back, STOP-STREAM-1). `candidates` (the engine's
    `show_probs`) lists the top tokens of the distribution the token was drawn
    from, after the filters, with their probabilities.
    """

    request_id: int
    token_id: int | None
    text: str
    finish_reason: str | None = None  # "stop", "length" or "error"
    logprobs: TokenLogprobs | None = None
    candidates: list[tuple[int, float]] | None = None
    error: str | None = None


@dataclass
class Request:
    """A request in flight: its prompt, parameters, cache blocks, output and timings."""

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    arrival: float
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose K/V are in the cache
    draft_cached: int = 0  # positions a second-model drafter has cached
    target_passes: int = 0  # forward passes of the target that gave this request tokens
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_pause: int = 0  # steps left without drafts (`Engine._adapt_drafting`)
    draft_backoff: int = 0  # the pause after the next pass that accepts no draft
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.stop.token_ids

    def new_tokens(self) -> list[int]:
        """Tokens this step must run through the model: the prompt, then the last token."""
        sequence = self.prompt_ids + self.output_ids
        return sequence[self.num_cached :]


@dataclass(frozen=True)
class RequestOutput:
    """A finished (or running) request, summarised (the CLI's `--json` object)."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    seed: int | None
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    prompt_tokens_per_s: float | None
    tokens_per_s: float | None
    inter_token_latencies_s: list[float]
    logprobs: list[TokenLogprobs] | None
    error: str | None = None
    # Speculative decoding: drafts proposed and accepted, their ratio, and tokens
    # generated per forward pass of the target (1 without speculation).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None
    tokens_per_target_pass: float | None = None


# ---------------------------------------------------------------- the engine


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        weights: the model (`decodespec.reference.loader.load_weights`).
        tokenizer: encode/decode, `token_bytes`, `eos_token_ids`.
        backend: "spec" or "triton".
        naive: no KV cache; recompute every sequence at every step.
        block_size: positions per cache block.
        cache_tokens: cache capacity in positions, over all requests.
        show_probs: with N > 0, events carry the top-N candidates (N <= 20).
        seed: seeds the generator that gives unseeded requests their seed.
        speculate: a drafter for speculative decoding: "ngram" (prompt lookup),
            "layers:N" (the model's first N layers) or "model" (`draft_model`).
        num_draft: K >= 1, the most draft tokens per request and step.
        draft_model: the second model of `speculate="model"` (same vocabulary).

    Example (see `generate` for one request):
        >>> engine = Engine(weights, tokenizer)                    # doctest: +SKIP
        >>> first = engine.add_request(ids_a, SamplingParams(seed=1))  # doctest: +SKIP
        >>> while engine.has_unfinished():                         # doctest: +SKIP
        ...     for event in engine.step(): print(event.text, end="")
    """

    def __init__(
        self,
        weights: ModelWeights,
        tokenizer: object,
        *,
        backend: str = "spec",
        naive: bool = False,
        block_size: int = 16,
        cache_tokens: int = 16_384,
        show_probs: int = 0,
        seed: int | None = None,
        speculate: str | None = None,
        num_draft: int = 4,
        draft_model: ModelWeights | None = None,
    ) -> None:
        self.weights = weights
        self.config = weights.config
        self.tokenizer = tokenizer
        self.backend = get_backend(backend)
        check_backend_device(self.backend, weights.device)
        self.naive = naive
        if not 0 <= show_probs <= sampling.MAX_TOP_LOGPROBS:
            raise ValueError(f"show_probs must be in [0, 20], got {show_probs}")
        self.show_probs = show_probs
        self.cache = None
        if not naive:
            self.cache = PagedKVCache(
                self.config,
                num_blocks=max(1, -(-cache_tokens // block_size)),
                block_size=block_size,
                dtype=weights.dtype,
                device=weights.device,
            )
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.num_draft = num_draft
        self.drafter = self._make_drafter(speculate, draft_model)
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._next_id = 0

    # -- requests

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> int:
        """Queue a request; it joins the batch at the next step with room for it.

        Raises:
            ValueError: invalid parameters or prompt for this model
                (PARAM-REQUEST-1), or a prompt the whole cache cannot hold.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        sampling.validate_request(
            params,
            prompt_ids,
            vocab_size=self.config.vocab_size,
            max_context=self.config.max_context,
        )
        if self.cache is not None:
            needed = self.cache.blocks_for(len(prompt_ids) + 1)
            if needed > self.cache.allocator.num_blocks:
                raise ValueError(
                    f"the prompt needs {needed} cache blocks; the cache has "
                    f"{self.cache.allocator.num_blocks} (raise cache_tokens)"
                )
        params = sampling.resolve_seed(params, self.generator)
        request = Request(
            id=self._next_id,
            prompt_ids=prompt_ids,
            params=params,
            stop=StopChecker(
                params,
                eos_token_ids=self.eos_token_ids,
                token_bytes=self.tokenizer.token_bytes,
                prompt_len=len(prompt_ids),
                max_context=self.config.max_context,
            ),
            arrival=time.perf_counter(),
        )
        self._next_id += 1
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def output(self, request_id: int) -> RequestOutput:
        """The request's text, ids, finish reason and timings so far."""
        r = self.requests[request_id]
        times = r.token_times
        ttft = times[0] - r.arrival if times else None
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return RequestOutput(
            request_id=r.id,
            text=r.stop.text,
            token_ids=r.output_ids,
            finish_reason=r.finish_reason,
            seed=r.params.seed,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            ttft_s=ttft,
            prompt_tokens_per_s=len(r.prompt_ids) / ttft if ttft else None,
            # Decode speed: tokens after the first, over the time they took.
            tokens_per_s=len(gaps) / sum(gaps) if gaps and sum(gaps) > 0 else None,
            inter_token_latencies_s=gaps,
            logprobs=r.logprobs if r.params.top_logprobs is not None else None,
            error=r.error,
            draft_tokens=r.drafted,
            accepted_tokens=r.accepted,
            acceptance_rate=r.accepted / r.drafted if r.drafted else None,
            tokens_per_target_pass=len(r.output_ids) / r.target_passes if r.target_passes else None,
        )

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[Event]:
        """Stream one request's events (other queued requests advance alongside)."""
        request_id = self.add_request(prompt_ids, params)
        while self.requests[request_id].finish_reason is None:
            for event in self.step():
                if event.request_id == request_id:
                    yield event

    # -- one step of the loop

    def _make_drafter(
        self, speculate: str | None, draft_model: ModelWeights | None
    ) -> Drafter | None:
        if speculate is None:
            if draft_model is not None:
                raise ValueError("draft_model is only used with speculate='model'")
            return None
        if self.cache is None:
            raise ValueError(
                "speculative decoding needs the KV cache: it cannot run with naive=True"
            )
        ops = {"attention": self.backend.paged_attention, "append": self.backend.append_kv}
        if speculate == "ngram":
            return NgramDrafter()
        if speculate.startswith("layers:"):
            count = speculate.removeprefix("layers:")
            if not count.isdigit():
                raise ValueError(f"speculate {speculate!r}: N of layers:N must be an integer")
            return ModelDrafter.first_layers(self.weights, self.cache, int(count), **ops)
        if speculate == "model":
            if draft_model is None:
                raise ValueError("speculate='model' needs draft_model")
            return ModelDrafter.second_model(draft_model, self.weights, self.cache, **ops)
        raise ValueError(f"unknown speculate {speculate!r}: choose ngram, layers:N or model")

    @torch.inference_mode()  # no autograd bookkeeping on any op of the loop
    def step(self) -> list[Event]:
        """Admit waiting requests, draft, run one forward pass, choose tokens, check stops."""
        events: list[Event] = []
        self._admit()
        batch = [r for r in list(self.running) if self._reserve(r, events)]
        if not batch:
            return events
        drafts = self._draft(batch)
        logits = self._forward(batch, [d.tokens for d in drafts])
        # One logits row per position that gets a token: after the last token, then
        # after each draft (each with the output so far that far, for the penalties).
        owners = [r for r, d in zip(batch, drafts, strict=True) for _ in range(len(d.tokens) + 1)]
        outputs = [
            r.output_ids + d.tokens[:j]
            for r, d in zip(batch, drafts, strict=True)
            for j in range(len(d.tokens) + 1)
        ]
        tensors = self._sampling_tensors(owners, outputs, logits.device)
        first = list(itertools.accumulate((len(d.tokens) + 1 for d in drafts), initial=0))
        emitted, invalid = self._choose(drafts, logits, tensors, first)

        rows = [first[b] + i for b, tokens in enumerate(emitted) for i in range(len(tokens))]
        row_tokens = torch.tensor(
            [t for tokens in emitted for t in tokens], dtype=torch.int64, device=logits.device
        )
        row_tensors = self._pick(tensors, rows)
        row_requests = [owners[row] for row in rows]
        logprobs = self._logprobs(row_requests, logits[rows], row_tokens, row_tensors, [])
        candidates = self._candidates(row_requests, logits[rows], row_tensors, [])
        now = time.perf_counter()
        done = 0
        for b, request in enumerate(batch):
            if b in invalid:
                events.append(self._fail(request, "the model produced NaN or infinite logits"))
                continue
            request.target_passes += 1
            request.drafted += len(drafts[b].tokens)
            request.accepted += len(emitted[b]) - 1
            if drafts[b].tokens:
                self._adapt_drafting(request, accepted=len(emitted[b]) - 1)
            for i, token in enumerate(emitted[b]):
                row = done + i
                request.token_times.append(now)
                if logprobs[row] is not None:
                    request.logprobs.append(logprobs[row])
                delta = request.stop.append(token)
                events.append(
                    Event(
                        request.id,
                        token,
                        delta.text,
                        delta.finish_reason,
                        logprobs[row],
                        candidates[row],
                    )
                )
                if delta.finish_reason is not None:
                    # A stop inside an accepted run cuts it: the later tokens are dropped.
                    self._finish(request, delta.finish_reason)
                    break
            done += len(emitted[b])
            if request.finish_reason is None:
                self._roll_back(request)
        return events

    def _admit(self) -> None:
        """Move waiting requests into the batch, first come first served, while blocks last."""
        while self.waiting:
            request = self.waiting[0]
            if self.cache is not None:
                needed = self.cache.blocks_for(len(request.prompt_ids) + 1)
                if needed > self.cache.allocator.num_free:
                    return  # it fits once running requests finish
                request.blocks = self.cache.allocator.allocate(needed)
            self.running.append(self.waiting.pop(0))

    def _grow(self, request: Request, positions: int) -> None:
        """Give the request blocks for `positions` positions (CacheFullError: none taken)."""
        assert self.cache is not None
        needed = self.cache.blocks_for(positions) - len(request.blocks)
        request.blocks += self.cache.allocator.allocate(max(0, needed))

    def _reserve(self, request: Request, events: list[Event]) -> bool:
        """Make sure the request's cache holds its new tokens; fail it if it cannot grow."""
        if self.cache is None:
            return True
        try:
            self._grow(request, request.num_cached + len(request.new_tokens()))
        except CacheFullError as error:
            events.append(self._fail(request, str(error)))
            return False
        return True

    def _draft(self, batch: list[Request]) -> list[Draft]:
        """The drafter's tokens for each request: at most K, what max_tokens and the
        context leave room for (the token after the drafts always comes too), and
        none for a request whose blocks cannot grow to hold them."""
        if self.drafter is None:
            return [Draft([]) for _ in batch]
        counts = []
        for r in batch:
            if r.draft_pause > 0:
                r.draft_pause -= 1
                counts.append(0)
                continue
            length = len(r.prompt_ids) + len(r.output_ids)
            count = min(self.num_draft, self.config.max_context - length - 1)
            if r.params.max_tokens is not None:
                count = min(count, r.params.max_tokens - len(r.output_ids) - 1)
            if count > 0:
                try:
                    self._grow(r, length + count)
                except CacheFullError:
                    count = 0  # no room for drafts: this step is plain decoding
            counts.append(max(count, 0))
        return self.drafter.propose(batch, counts, self._distributions)

    def _forward(self, batch: list[Request], drafts: list[list[int]]) -> Tensor:
        """Logits after each request's last token and after each of its drafts:
        `[Σ (len(drafts[b]) + 1), vocab]`, request by request."""
        device = self.weights.device
        if self.naive:
            rows = [
                forward_naive(
                    self.weights,
                    torch.tensor(r.prompt_ids + r.output_ids, device=device),
                    last_only=True,
                )
                for r in batch
            ]
            return torch.cat(rows)
        assert self.cache is not None
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

    def _sampling_tensors(
        self, requests: list[Request], outputs: list[list[int]], device: torch.device
    ) -> dict[str, Tensor]:
        """`sample`'s per-row tensors: row i has requests[i]'s parameters after `outputs[i]`."""
        return sampling.sampling_tensors(
            [r.params for r in requests],
            vocab_size=self.config.vocab_size,
            prompt_token_ids=[r.prompt_ids for r in requests],
            output_token_ids=outputs,
            eos_token_ids=self.eos_token_ids,
            device=device,
        )

    def _probs(self, logits: Tensor, tensors: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The distribution each row's token is drawn from, and which rows are valid.

        A sampled row: softmax of its processed logits (steps 1-8). A greedy
        row: the point mass at the token `sample` chooses, so verification
        compares drafts with exactly plain greedy's token (and skips the
        filters, which cannot change it). Invalid rows (SAMPLE-VALID-1) are
        all zeros.
        """
        rows, vocab = logits.shape
        probs = logits.new_zeros(rows, vocab)
        valid = torch.ones(rows, dtype=torch.bool, device=logits.device)
        is_greedy = (tensors["temperature"] == 0).tolist()
        greedy_rows = [i for i in range(rows) if is_greedy[i]]
        sampled_rows = [i for i in range(rows) if not is_greedy[i]]
        if greedy_rows:
            try:
                tokens = self.backend.sample(
                    logits[greedy_rows], **self._pick(tensors, greedy_rows)
                )
            except self.backend.invalid_logits_error as error:
                tokens = error.tokens.clamp(min=0)
                valid[[greedy_rows[j] for j in error.rows]] = False
            probs[greedy_rows, tokens] = 1
        while sampled_rows:
            try:
                processed = self.backend.process_logits(
                    logits[sampled_rows], **self._pick(tensors, sampled_rows, seed=False)
                )
            except self.backend.invalid_logits_error as error:
                bad = [sampled_rows[j] for j in error.rows]
                valid[bad] = False
                sampled_rows = [i for i in sampled_rows if i not in bad]
                continue  # again without the invalid rows
            probs[sampled_rows] = softmax(processed)
            break
        return torch.where(valid[:, None], probs, 0), valid

    @staticmethod
    def _pick(tensors: dict[str, Tensor], rows: list[int], seed: bool = True) -> dict[str, Tensor]:
        """The sampling tensors of some rows (without the seed: `process_logits`)."""
        return {k: v[rows] for k, v in tensors.items() if seed or k != "seed"}

    def _distributions(
        self, logits: Tensor, requests: list[Request], outputs: list[list[int]]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a drafter: probabilities, seeds, steps and validity of each row (`_probs`)."""
        tensors = self._sampling_tensors(requests, outputs, logits.device)
        probs, valid = self._probs(logits, tensors)
        return probs, tensors["seed"], tensors["step"], valid

    def _choose(
        self, drafts: list[Draft], logits: Tensor, tensors: dict[str, Tensor], first: list[int]
    ) -> tuple[list[list[int]], set[int]]:
        """Each request's emitted tokens, and the requests whose logits were invalid.

        A request without drafts samples its one token (`sample`); the others
        verify theirs (`verify_drafts`): the accepted drafts, then one more.
        Request b's rows are `first[b] .. first[b + 1] − 1`.
        """
        emitted: list[list[int]] = [[] for _ in drafts]
        invalid: set[int] = set()
        plain = [b for b, d in enumerate(drafts) if not d.tokens]
        if plain:
            rows = [first[b] for b in plain]
            try:
                tokens = self.backend.sample(logits[rows], **self._pick(tensors, rows))
                bad: list[int] = []
            except self.backend.invalid_logits_error as error:
                tokens, bad = error.tokens, error.rows
            for j, b in enumerate(plain):
                if j in bad:
                    invalid.add(b)
                else:
                    emitted[b] = [int(tokens[j])]
        drafted = [b for b, d in enumerate(drafts) if d.tokens]
        if not drafted:
            return emitted, invalid
        rows = [row for b in drafted for row in range(first[b], first[b + 1])]
        probs, valid = self._probs(logits[rows], self._pick(tensors, rows))
        k = max(len(drafts[b].tokens) for b in drafted)
        vocab = probs.shape[-1]
        target = probs.new_zeros(len(drafted), k + 1, vocab)
        draft_probs = probs.new_zeros(len(drafted), k, vocab)
        draft_tokens = torch.zeros(len(drafted), k, dtype=torch.int64, device=probs.device)
        num_draft = []
        at = 0
        for i, b in enumerate(drafted):
            draft = drafts[b]
            n = len(draft.tokens)
            target[i, : n + 1] = probs[at : at + n + 1]
            draft_tokens[i, :n] = torch.tensor(draft.tokens, device=probs.device)
            if draft.probs is None:  # a deterministic drafter: one-hot
                draft_probs[i, torch.arange(n, device=probs.device), draft_tokens[i, :n]] = 1
            else:
                draft_probs[i, :n] = draft.probs
            # Invalid target logits after draft j − 1 end the run before it: only the
            # tokens before them are decided (none, if the first row is invalid).
            bad = (~valid[at : at + n + 1]).nonzero()
            if len(bad) and int(bad[0]) == 0:
                invalid.add(b)
            num_draft.append(min(n, int(bad[0]) - 1) if len(bad) else n)
            at += n + 1
        heads = [first[b] for b in drafted]
        result = self.backend.verify_drafts(
            draft_tokens,
            draft_probs,
            target,
            torch.tensor(num_draft, dtype=torch.int64, device=probs.device),
            temperature=tensors["temperature"][heads],
            seed=tensors["seed"][heads],
            step=tensors["step"][heads],
        )
        for i, b in enumerate(drafted):
            if b not in invalid:
                emitted[b] = result.tokens[i, : int(result.num_accepted[i]) + 1].tolist()
        return emitted, invalid

    @staticmethod
    def _adapt_drafting(request: Request, accepted: int) -> None:
        """Draft less while drafts fail: a verification pass costs more than a plain
        step (it runs K + 1 tokens), so one that accepts nothing is a loss. After
        such a pass the request pauses drafting, twice as long as after the
        previous one (up to MAX_DRAFT_PAUSE steps); each pass that accepts a
        draft halves the pause. The drafting policy only looks at past passes,
        so the tokens keep the target's distribution."""
        if accepted == 0:
            request.draft_backoff = min(max(1, 2 * request.draft_backoff), MAX_DRAFT_PAUSE)
            request.draft_pause = request.draft_backoff
        else:
            request.draft_backoff //= 2

    def _roll_back(self, request: Request) -> None:
        """Forget the rejected drafts: the cache keeps the emitted sequence's positions
        only (its last token is run next step), and blocks past them go back."""
        if self.cache is None:
            return
        length = len(request.prompt_ids) + len(request.output_ids)
        request.num_cached = min(request.num_cached, length - 1)
        request.draft_cached = min(request.draft_cached, request.num_cached)
        keep = self.cache.blocks_for(length)
        if len(request.blocks) > keep:
            self.cache.allocator.free(request.blocks[keep:])
            del request.blocks[keep:]

    def _processed(self, logits: Tensor, tensors: dict[str, Tensor], rows: list[int]) -> Tensor:
        """The distribution each of `rows` was drawn from (steps 1-8), as logits."""
        return self.backend.process_logits(logits[rows], **self._pick(tensors, rows, seed=False))

    def _logprobs(
        self,
        batch: list[Request],
        logits: Tensor,
        tokens: Tensor,
        tensors: dict[str, Tensor],
        invalid: list[int],
    ) -> list[TokenLogprobs | None]:
        """Logprobs for the requests that asked (raw by default, LOGPROB-RAW-1)."""
        result: list[TokenLogprobs | None] = [None] * len(batch)
        for mode in ("raw", "processed"):
            rows = [
                i
                for i, r in enumerate(batch)
                if r.params.top_logprobs is not None
                and r.params.logprobs_mode == mode
                and i not in invalid
            ]
            if not rows:
                continue
            source = logits[rows] if mode == "raw" else self._processed(logits, tensors, rows)
            n = max(batch[i].params.top_logprobs or 0 for i in rows)
            lp = self.backend.compute_logprobs(source, tokens[rows], n)
            for j, i in enumerate(rows):
                top_n = batch[i].params.top_logprobs or 0
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

    def _candidates(
        self, batch: list[Request], logits: Tensor, tensors: dict[str, Tensor], invalid: list[int]
    ) -> list[list[tuple[int, float]] | None]:
        """Top-N tokens after the filters, with probabilities (`show_probs`)."""
        result: list[list[tuple[int, float]] | None] = [None] * len(batch)
        rows = [i for i in range(len(batch)) if i not in invalid]
        if not self.show_probs or not rows:
            return result
        processed = self._processed(logits, tensors, rows)
        n = min(self.show_probs, processed.shape[1])
        top = self.backend.compute_logprobs(processed, processed.argmax(dim=-1), n)
        for j, i in enumerate(rows):
            ids, lps = top.top_token_ids[j].tolist(), top.top_logprobs[j].tolist()
            result[i] = [
                (t, math.exp(lp)) for t, lp in zip(ids, lps, strict=True) if lp > -math.inf
            ]
        return result

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.running.remove(request)
        if self.cache is not None:
            self.cache.allocator.free(request.blocks)
        request.blocks = []

    def _fail(self, request: Request, message: str) -> Event:
        request.error = message
        self._finish(request, "error")
        return Event(request.id, None, "", "error", error=message)
