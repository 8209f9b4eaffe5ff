"""The engine: the decode loop over the spec's stages, with continuous batching.

One `step()` runs one forward pass for every running request — the whole
prompt of a request that just joined (prefill), one token for the others
(decode) — samples one token per request, checks stop conditions, and
returns an event per request. Requests join and leave between steps. The
stage functions are the spec's or, with the `triton` backend, the kernels'
(same names, same signatures); the engine code is the same for both.

With `naive=True` there is no KV cache: every step recomputes every request's
whole sequence (`forward_naive`), which is what the cache saves.
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

from spec import append, attention, sampling
from spec.forward import ModelWeights, PagedBatch, forward_cached, forward_naive
from spec.sampling import InvalidLogitsError, SamplingParams
from spec.stop import StopChecker

from .cache import CacheFullError, PagedKVCache

# ---------------------------------------------------------------- backends


STAGE_OPERATIONS = ("paged_attention", "append_kv", "sample", "process_logits", "compute_logprobs")


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
    invalid_logits_error: type[ValueError] = InvalidLogitsError
    kernel_ops: tuple[str, ...] = ()


SPEC_BACKEND = Backend(
    "spec",
    attention.paged_attention,
    append.append_kv,
    sampling.sample,
    sampling.process_logits,
    sampling.compute_logprobs,
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
    kernels = importlib.import_module("kernels")
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
    if not importlib.import_module("kernels.checks").INTERPRET:
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


# ---------------------------------------------------------------- the engine


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        weights: the model (`reference.loader.load_weights`).
        tokenizer: encode/decode, `token_bytes`, `eos_token_ids`.
        backend: "spec" or "triton".
        naive: no KV cache; recompute every sequence at every step.
        block_size: positions per cache block.
        cache_tokens: cache capacity in positions, over all requests.
        show_probs: with N > 0, events carry the top-N candidates (N <= 20).
        seed: seeds the generator that gives unseeded requests their seed.

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
        )

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[Event]:
        """Stream one request's events (other queued requests advance alongside)."""
        request_id = self.add_request(prompt_ids, params)
        while self.requests[request_id].finish_reason is None:
            for event in self.step():
                if event.request_id == request_id:
                    yield event

    # -- one step of the loop

    @torch.inference_mode()  # no autograd bookkeeping on any op of the loop
    def step(self) -> list[Event]:
        """Admit waiting requests, run one forward pass, sample, check stops."""
        events: list[Event] = []
        self._admit()
        batch = [r for r in list(self.running) if self._reserve(r, events)]
        if not batch:
            return events
        logits = self._forward(batch)
        tensors = sampling.sampling_tensors(
            [r.params for r in batch],
            vocab_size=self.config.vocab_size,
            prompt_token_ids=[r.prompt_ids for r in batch],
            output_token_ids=[r.output_ids for r in batch],
            eos_token_ids=self.eos_token_ids,
            device=logits.device,
        )
        try:
            tokens = self.backend.sample(logits, **tensors)
            invalid: list[int] = []
        except self.backend.invalid_logits_error as error:
            tokens, invalid = error.tokens, error.rows
        now = time.perf_counter()
        logprobs = self._logprobs(batch, logits, tokens, tensors, invalid)
        candidates = self._candidates(batch, logits, tensors, invalid)
        for row, request in enumerate(batch):
            if row in invalid:
                events.append(self._fail(request, "the model produced NaN or infinite logits"))
                continue
            token = int(tokens[row])
            request.token_times.append(now)
            if logprobs[row] is not None:
                request.logprobs.append(logprobs[row])
            delta = request.stop.append(token)
            if delta.finish_reason is not None:
                self._finish(request, delta.finish_reason)
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

    def _reserve(self, request: Request, events: list[Event]) -> bool:
        """Make sure the request's cache holds its new tokens; fail it if it cannot grow."""
        if self.cache is None:
            return True
        needed = self.cache.blocks_for(request.num_cached + len(request.new_tokens()))
        try:
            request.blocks += self.cache.allocator.allocate(max(0, needed - len(request.blocks)))
        except CacheFullError as error:
            events.append(self._fail(request, str(error)))
            return False
        return True

    def _forward(self, batch: list[Request]) -> Tensor:
        """`[len(batch), vocab]` logits of each request's next token."""
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
        token_ids, positions, slots, query_start = [], [], [], [0]
        for r in batch:
            new = r.new_tokens()
            token_ids += new
            positions += range(r.num_cached, r.num_cached + len(new))
            slots += self.cache.slots(r.blocks, r.num_cached, len(new))
            query_start.append(query_start[-1] + len(new))
        width = max(len(r.blocks) for r in batch)
        block_table = [r.blocks + [0] * (width - len(r.blocks)) for r in batch]
        seq_lens = [r.num_cached + len(r.new_tokens()) for r in batch]

        def tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        paged = PagedBatch(
            positions=tensor(positions),
            query_start=tensor(query_start),
            seq_lens=tensor(seq_lens),
            block_table=tensor(block_table),
            slot_mapping=tensor(slots),
            logits_indices=tensor(query_start[1:]) - 1,
        )
        logits = forward_cached(
            self.weights,
            tensor(token_ids),
            paged,
            self.cache.layers,
            attention=self.backend.paged_attention,
            append=self.backend.append_kv,
        )
        for r, length in zip(batch, seq_lens, strict=True):
            r.num_cached = length
        return logits

    def _processed(self, logits: Tensor, tensors: dict[str, Tensor], rows: list[int]) -> Tensor:
        """The distribution each of `rows` was drawn from (steps 1-8), as logits."""
        picked = {k: v[rows] for k, v in tensors.items() if k != "seed"}
        return self.backend.process_logits(logits[rows], **picked)

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
