"""The engine: the decode loop over the spec's stages, with continuous batching.

One `step()` is scheduler → (drafter) → model runner → postprocess, as in
nano-vllm: the scheduler picks the requests of the pass and gives them cache
blocks (admission, growth, preemption, slots for drafts: `scheduler.py`,
`block_manager.py`); with speculative decoding the drafter proposes tokens
(`drafters.py`); the runner runs one forward pass for all of them — the
prompt of a request that just joined (prefill), one token for the others
(decode), drafts too — and its sampler chooses their tokens (`runner.py`,
`sampler.py`); postprocessing appends each token to its request and returns
what the step produced for it. Requests join and leave between steps.
Every request's tokens are those of the spec's loop
(`decodespec.spec.generate`) run on it alone.

A failure inside a pass fails only the request that causes it: the pass is
undone and each request run alone; one that still fails finishes with
reason "error" and a message. With `naive=True` there is no KV cache: every
step recomputes every request's whole sequence, which is what the cache saves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch

from decodespec.spec import params as sampling_params
from decodespec.spec.forward import ModelWeights
from decodespec.spec.params import SamplingParams
from decodespec.spec.stop import StopChecker
from decodespec.spec.token_mask import bitmask_words

from . import cpu_linear, native_step
from .backend import check_backend_device, get_backend
from .batch_invariance import batch_invariant_backend, require_row_invariance, row_blocked
from .block_manager import BlockManager, NaiveBlockManager
from .cache import PagedKVCache
from .drafters import Drafter, make_drafter
from .grammar import DEFAULT_BACKEND as DEFAULT_GRAMMAR_BACKEND
from .grammar import GrammarCompiler, GrammarError
from .logits_state import LogitsState
from .request import Draft, PassOutcome, Request, RequestOutput, RequestStepOutput
from .request_options import RequestOptions
from .runner import ModelRunner, NaiveModelRunner, PagedModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .weight_formats import describe


def _check_int(name: str, value: object, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


# Chunked prefill's tokens per pass, and a long prompt's chunks while others decode
# (`scheduler.py`). On the bundled model, 2 cores (`make bench-chunked`,
# results/chunked-prefill-cpu.json, best of 3 rounds): 16 short chats at once get their
# first token at p50 / p99 182 / 278 ms with 128 (225 / 357 with 64, 184 / 389 with
# 32); 4 requests decoding beside a 2,000-token prompt keep 62-65% of their rate
# without it with 64 tokens every 12 passes (135 of 218 tokens/s), 43-45% with 8 every
# pass, 6% with what the budget leaves, and the prompt gets its first token in
# 11.0-12.4 s (8.8-11.3 with 8 every pass; 4.8 whole, alone on the cores).
DEFAULT_TOKEN_BUDGET = 128
DEFAULT_LONG_PROMPT_CHUNK = 64
DEFAULT_LONG_PROMPT_INTERVAL = 12

# Seeds the engine draws are below this (every JSON client reads them exactly).
DRAWN_SEEDS = 2**53


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        weights: the model (`decodespec.reference.loader.load_weights`).
        tokenizer: encode/decode, `token_bytes`, `eos_token_ids`.
        backend: "spec" (the definition), "torch" (attention batched across requests)
            or "triton" (the kernels; `backend.py`).
        naive: no KV cache; recompute every sequence at every step.
        block_size: positions per cache block, >= 1.
        cache_tokens: cache capacity in positions over all requests, >= 1
            (rounded up to whole blocks).
        prefix_caching: keep full blocks after their request finishes and let
            requests that start with the same tokens map them instead of
            prefilling them again (LOOP-PREFIX-1; no effect with naive).
        show_probs: with N > 0, events carry the top-N candidates (N <= 20).
        seed: seeds the generator that gives unseeded requests their seed.
        speculate: a drafter for speculative decoding: "ngram" (prompt lookup),
            "layers:N" (the model's first N layers) or "model" (`draft_model`).
        num_draft: K >= 1, the most draft tokens per request and step.
        draft_model: the second model of `speculate="model"` (same vocabulary).
        grammar_backend: the library that compiles structured outputs, "llguidance"
            (the default) or "xgrammar" (`grammar_backends.py`).
        batch_invariant: where the engine is not batch-invariant by construction
            (it is with the torch backend's native step: float32, int8 or int4
            weights on the CPU with the C library), the mode that makes it so: a
            request's tokens and logprobs bitwise the same alone or in any batch,
            with or without a cached prefix (`batch_invariance.py`);
            `BatchInvarianceUnavailable` (a ValueError) where this machine's GEMM
            breaks the mode's premise for these weights. `self.batch_invariant`
            says whether the engine is, either way.
        token_budget: about how many tokens a pass runs (chunked prefill,
            `scheduler.py`): decoding requests one each, prompts in chunks of
            what is left; None runs every prompt whole in one pass, as naive
            and batch-invariant engines always do.
        long_prompt_chunk: a long prompt's tokens per chunk (one longer than
            `token_budget`) while other requests decode, so that they keep
            most of their rate; None: what the budget leaves, every pass.
        long_prompt_interval: passes from one such chunk to the next (1:
            every pass).

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
        prefix_caching: bool = True,
        show_probs: int = 0,
        seed: int | None = None,
        speculate: str | None = None,
        num_draft: int = 4,
        draft_model: ModelWeights | None = None,
        grammar_backend: str = DEFAULT_GRAMMAR_BACKEND,
        batch_invariant: bool = False,
        token_budget: int | None = DEFAULT_TOKEN_BUDGET,
        long_prompt_chunk: int | None = DEFAULT_LONG_PROMPT_CHUNK,
        long_prompt_interval: int = DEFAULT_LONG_PROMPT_INTERVAL,
    ) -> None:
        flags = {"naive": naive, "prefix_caching": prefix_caching}
        for name, flag in {**flags, "batch_invariant": batch_invariant}.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        block_size = _check_int("block_size", block_size, 1)
        cache_tokens = _check_int("cache_tokens", cache_tokens, 1)
        self.show_probs = _check_int("show_probs", show_probs, 0)
        if show_probs > sampling_params.MAX_TOP_LOGPROBS:
            raise ValueError(f"show_probs must be in [0, 20], got {show_probs}")
        self.num_draft = _check_int("num_draft", num_draft, 1)
        if token_budget is not None:
            _check_int("token_budget", token_budget, 1)
        if long_prompt_chunk is not None:
            _check_int("long_prompt_chunk", long_prompt_chunk, 1)
        self.long_prompt_interval = _check_int("long_prompt_interval", long_prompt_interval, 1)
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            if _check_int("seed", seed, 0) >= 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {seed}")
            self.generator.manual_seed(seed)
        self.config = weights.config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.backend = get_backend(backend)
        check_backend_device(self.backend, weights.device)
        # The backend's kernels for the projections (weight_formats, cpu_linear).
        prepared = self.backend.prepare_weights(weights)
        native = None if naive else self.backend.native_step(prepared)
        # With the native step every pass computes each row alone, in one order (its
        # products, norms, attention; a lone row's sampling stages on one thread): a request's
        # bits are its own whatever the batch, by construction. Elsewhere the mode's
        # stages give it where the machine's GEMM allows (batch_invariance).
        self.batch_invariant = native is not None or batch_invariant
        if native is not None and (token_budget is None or token_budget > native.max_tokens):
            token_budget = native.max_tokens  # every pass on the step, a long prompt in chunks
        if batch_invariant and native is None:
            self.backend = batch_invariant_backend(self.backend)
            prepared = self.backend.prepare_weights(weights)
            # Prompts whole: a row's attention bits there depend on its pass's query
            # count (ATTN-INVARIANT-1), so a prompt cut into other chunks would change them.
            token_budget = None
        # naive passes recompute every sequence whole anyway
        self.token_budget = None if naive else token_budget
        self.long_prompt_chunk = None if self.token_budget is None else long_prompt_chunk
        weights = prepared
        if draft_model is not None:
            draft_model = self.backend.prepare_weights(draft_model)
        if batch_invariant and native is None:
            weights = row_blocked(weights)
            draft_model = row_blocked(draft_model) if draft_model is not None else None
            # the mode's premise, measured on this machine: refused where it fails
            require_row_invariance(self.backend.name, weights, draft_model)
        self.weights = weights
        self.sampler = Sampler(self.backend, self.config.vocab_size, self.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(tokenizer, self.config.vocab_size, grammar_backend)
        self.cache: PagedKVCache | None = None
        self.runner: ModelRunner
        if naive:
            self.block_manager: BlockManager | NaiveBlockManager = NaiveBlockManager()
            self.runner = NaiveModelRunner(weights, self.backend, self.sampler)
        else:
            num_blocks = -(-cache_tokens // block_size)
            self.cache = PagedKVCache(
                self.config, num_blocks=num_blocks, block_size=block_size, dtype=weights.dtype,
                device=weights.device,
            )  # fmt: skip
            self.block_manager = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
            self.runner = PagedModelRunner(weights, self.backend, self.sampler, self.cache, native)
        self.drafter: Drafter | None = None
        if speculate is not None:
            self.drafter = make_drafter(
                speculate, weights, self.cache, self.backend, self.sampler, draft_model
            )
        elif draft_model is not None:
            raise ValueError("draft_model is only used with speculate='model'")
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_context,
            num_draft=self.num_draft if self.drafter is not None else 0,
            token_budget=self.token_budget,
            long_prompt_chunk=self.long_prompt_chunk,
            long_prompt_interval=self.long_prompt_interval,
        )
        self.path = self._describe_path()
        self.requests: dict[int, Request] = {}
        # What each `generate` stream has yet to yield.
        self._streams: dict[int, deque[RequestStepOutput]] = {}
        self._next_id = 0

    def _describe_path(self) -> str:
        """What computes every request: the weights' format, the backend, the decode
        step (the native C step, or why not), whether a request's bits are its own
        whatever the batch, and the token budget, in one line."""
        parts = [describe(self.weights), f"backend {self.backend.name}"]
        if products := cpu_linear.products(self.weights):
            parts.append(products)
        native = getattr(self.runner, "native", None)
        if native is not None:
            parts.append(native.description)
        elif self.backend.name == "torch":  # the backend that has one: why it is off
            why = native_step.status(self.weights).removeprefix("off: ")
            parts.append(f"native step off ({why})")
        if native is not None:
            parts.append("batch-invariant by construction")
        elif self.batch_invariant:
            parts.append("batch-invariant mode")
        else:
            parts.append("not batch-invariant (--batch-invariant)")
        budget, chunk = self.token_budget, self.long_prompt_chunk
        if budget is None:
            parts.append("prompts whole")
        else:
            parts.append(f"token budget {budget}")
            interval = self.long_prompt_interval
            if chunk is not None:
                every = "a pass" if interval == 1 else f"every {interval} passes"
                parts.append(f"a long prompt {chunk} tokens {every} beside decoding")
        return "; ".join(parts)

    # -- requests

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> int:
        """Queue a request; it joins the batch at the next step with room for it.

        `options` (`request_options.py`, each field declared there once; None:
        none):
        `arrival` is where its time to first token starts (default now);
        `num_draft` caps its drafts per step below the engine's K (0: no
        speculation for it; only an engine with a drafter takes one > 0);
        `structured_output` constrains every token to a grammar (MASK-ADVANCE-1),
        compiled here, before the request is queued.

        `prompt_logprobs` k scores the prompt (vLLM's prompt_logprobs): the
        output's `prompt_logprobs` holds None for position 0, then for each
        prompt token t >= 1 a `TokenLogprobs` (its logprob given tokens < t, its
        rank, the top-k) of the raw logits, `compute_logprobs(forward_naive(weights,
        prompt)[t - 1:t], [prompt[t]], k)` (LOGPROB-RAW-1: no processor, no
        temperature, whatever the request's parameters). Every position is scored
        once, across preemptions; the prefix cache serves none of the positions
        still to score (they need logits), and the request's blocks are still
        cached for others. The first step output carries them too.

        Raises:
            TypeError, ValueError: invalid parameters or prompt for this model
                (PARAM-REQUEST-1), a `num_draft` above the engine's K, or a
                request the whole cache could never hold.
            GrammarError: a structured output that does not compile, or one
                with `ignore_eos` (its stop token is how a grammar ends).
        """
        prompt_ids = sampling_params.check_token_ids(
            "prompt_ids", prompt_ids, self.config.vocab_size
        )
        sampling_params.validate_request(
            params,
            prompt_ids,
            vocab_size=self.config.vocab_size,
            max_context=self.config.max_context,
        )
        if options is None:
            options = RequestOptions()
        elif not isinstance(options, RequestOptions):
            raise TypeError(f"options must be a RequestOptions, got {type(options).__name__}")
        options.check_num_draft(self.num_draft if self.drafter is not None else 0)
        if options.arrival is None:
            options = replace(options, arrival=time.perf_counter())
        structured_output = options.structured_output
        matcher = None
        if structured_output is not None:
            if params.ignore_eos:
                raise GrammarError(
                    "ignore_eos",
                    "ignore_eos cannot be combined with a structured output: the grammar "
                    "ends the output with the end-of-sequence token",
                )
            matcher = self.grammar_compiler.matcher(structured_output)
        if params.seed is None:  # the one place seeds are drawn (SAMPLE-SEED-1)
            drawn = sampling_params.resolve_seed(params, self.generator).seed
            # Below 2**53: the seed is reported back, and a JSON client that reads
            # numbers as doubles (JavaScript) must get exactly the seed used.
            params = replace(params, seed=drawn % DRAWN_SEEDS)
        request = Request(
            id=self._next_id,
            prompt_ids=prompt_ids,
            stop_checker=StopChecker(
                params,
                eos_token_ids=self.eos_token_ids,
                token_bytes=self.tokenizer.token_bytes,
                prompt_len=len(prompt_ids),
                max_context=self.config.max_context,
            ),
            logits_state=LogitsState(params, prompt_ids, matcher=matcher),
            options=options,
            prompt_logprobs=[] if options.prompt_logprobs is None else [None],
        )
        self.scheduler.add(request)
        self.requests[request.id] = request
        self._next_id += 1
        return request.id

    def abort(self, request_id: int) -> bool:
        """End a request now (finish reason "abort") and free its blocks; False if it
        had already finished."""
        request = self._request(request_id)
        if request.finish_reason is not None:
            return False
        self.scheduler.finish(request, "abort")
        return True

    def release(self, request_id: int) -> RequestOutput:
        """Forget a finished request and return its output. A long-running server
        releases each request it is done with, so that finished requests do not
        pile up in memory."""
        request = self._request(request_id)
        if request.finish_reason is None:
            raise ValueError(f"request {request_id} has not finished: abort it first")
        del self.requests[request_id]
        return self._output(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def output(self, request_id: int) -> RequestOutput:
        """The request's text, ids, finish reason and timings so far."""
        return self._output(self._request(request_id))

    def _output(self, request: Request) -> RequestOutput:
        return replace(RequestOutput.of(request), path=self.path)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        options: RequestOptions | None = None,
    ) -> Iterator[RequestStepOutput]:
        """Stream one request's step outputs; other requests advance alongside, and
        several streams may be read in turns (each gets all of its outputs). Closing
        the generator early aborts the request."""
        request_id = self.add_request(prompt_ids, params, options)
        pending = self._streams[request_id] = deque()
        try:
            while pending or self.requests[request_id].finish_reason is None:
                if not pending:
                    self.step()
                while pending:
                    yield pending.popleft()
        finally:
            del self._streams[request_id]
            self.abort(request_id)

    def _request(self, request_id: int) -> Request:
        if request_id not in self.requests:
            raise ValueError(f"no request with id {request_id!r}")
        return self.requests[request_id]

    # -- one step of the loop

    @torch.inference_mode()  # no autograd bookkeeping on any op of the loop
    def step(self) -> list[RequestStepOutput]:
        """Schedule, draft and run one pass, then postprocess: append each request's
        tokens. The pass changes no request, so a failed one is simply dropped."""
        batch = self.scheduler.schedule()
        try:
            outcomes = self._pass(batch) if batch else []
        except Exception:  # someone's fault: run each request alone to find whose
            outcomes = [self._pass_alone(r) for r in batch]
        now = time.perf_counter()
        outputs: list[RequestStepOutput] = []
        for request, outcome in zip(batch, outcomes, strict=True):
            outputs += self.scheduler.postprocess(request, outcome, now)
        for output in outputs:
            if output.request_id in self._streams:
                self._streams[output.request_id].append(output)
        return outputs

    def _pass(self, batch: list[Request]) -> list[PassOutcome]:
        for request in batch:  # before anything reads the positions (drafters included)
            if request.prefix_copy is not None:
                self.cache.copy_positions(*request.prefix_copy)
        if self.drafter is None:
            drafts = [Draft([]) for _ in batch]
        else:
            drafts = self.drafter.propose(batch, [r.draft_slots for r in batch])
        drafts = [self._constrain(r, d) for r, d in zip(batch, drafts, strict=True)]
        return self.runner.run(batch, drafts, self.show_probs)

    def _constrain(self, request: Request, draft: Draft) -> Draft:
        """The draft with its grammar's masks, cut before the first token the grammar
        rejects (MASK-ADVANCE-1): one sweep of the matcher (`grammar_rows`)."""
        words = bitmask_words(self.config.vocab_size)
        allowed, bitmask = request.logits_state.grammar_rows(draft.tokens, words)
        if bitmask is None:
            return draft
        probs = None if draft.probs is None else draft.probs[:allowed]
        return replace(draft, tokens=draft.tokens[:allowed], probs=probs, bitmask=bitmask)

    def _pass_alone(self, request: Request) -> PassOutcome:
        try:
            return self._pass([request])[0]
        except Exception as error:
            return PassOutcome(error=f"{type(error).__name__}: {error}")
