"""What the engine keeps per request and what it hands back: requests, the
outputs of each step, drafts and pass outcomes, and summaries."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from decodespec.spec.generate import StepOutput, TokenLogprobs
from decodespec.spec.params import SamplingParams
from decodespec.spec.stop import StopChecker, StreamDelta

from .block_allocator import PrefixKey
from .logits_state import LogitsState
from .request_options import RequestOptions

# The longest a request goes without drafts after passes that accepted none.
MAX_DRAFT_PAUSE = 16


@dataclass(frozen=True)
class RequestStepOutput(StepOutput):
    """What one engine step produced for one request of the batch: the spec loop's
    `StepOutput` (token, text newly safe to show, finish reason, logprobs) and
    the request's id, plus what only the engine has.

    `token_id` is None only for an error or abort. `finish_reason` may also be
    "error" (with `error`, the message) or "abort". `candidates` (the engine's
    `show_probs`) lists the top tokens of the distribution the token was drawn
    from, after the filters, with their probabilities.
    """

    token_id: int | None
    finish_reason: str | None = None  # "stop", "length", "error" or "abort"
    logprobs: TokenLogprobs | None = None
    request_id: int = -1
    candidates: list[tuple[int, float]] | None = None
    error: str | None = None
    # With prompt_logprobs, the request's first token carries the prompt's scores
    # (`Request.prompt_logprobs`), so that a stream can send them first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class Draft:
    """A request's proposed tokens and the distributions they were drawn from.

    `probs` is `[len(tokens), vocab]`, or None for a deterministic drafter
    (one-hot distributions). `bitmask` is the grammar's mask of each row the
    pass runs for the request, `[len(tokens) + 1, words]` (after its output,
    then after each draft: `LogitsState.grammar_rows`), None without a grammar.
    """

    tokens: list[int]
    probs: Tensor | None = None
    bitmask: Tensor | None = None
    # Positions the drafter's own cache holds after drafting (a second model's cache);
    # None for a drafter that keeps none, or shares the target's.
    drafter_cached: int | None = None


@dataclass(frozen=True)
class PassOutcome:
    """What one forward pass gave one request: its tokens (with their logprobs and
    candidates), how many drafts it verified and the cache positions it wrote, or the
    error that fails it. A pass changes no request: the scheduler applies its outcome
    (`Scheduler.postprocess`), and a failed pass's outcome is dropped."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    candidates: list[list[tuple[int, float]] | None] = field(default_factory=list)
    drafted: int = 0
    error: str | None = None
    # Scores of prompt tokens this pass's positions gave (`Request.prompt_positions`).
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Positions whose K/V the target's cache holds after the pass (None: no cache), and
    # the drafter's own cache (`Draft.drafter_cached`).
    num_cached: int | None = None
    draft_cached: int | None = None


@dataclass
class Request:
    """A request in flight: its prompt, parameters, cache blocks, output and timings.

    `stop_checker` decides the stop conditions and the text (the spec's stop stage);
    `logits_state` is what the logits stage reads (`logits_state.py`); both
    are advanced with every emitted token (`emit`).
    """

    id: int
    prompt_ids: list[int]
    stop_checker: StopChecker
    logits_state: LogitsState
    # Its cap on drafts, its prompt scoring, its arrival (resolved: never None).
    options: RequestOptions
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose K/V are in the cache
    # Of `new_tokens()`, how many the next pass runs (`Scheduler.schedule`): all of them,
    # or a chunk of a prompt cut to the pass's token budget.
    num_scheduled: int = 0
    draft_slots: int = 0  # drafts this pass has cache slots for (`Scheduler.schedule`)
    # More new tokens at admission than a pass's token budget (`Scheduler.admit`): while
    # other requests decode, it takes the scheduler's `long_prompt_chunk` in one pass of
    # every `long_prompt_interval`, after waiting `long_prompt_wait` passes more.
    long_prompt: bool = False
    long_prompt_wait: int = 0
    # Keys of the leading full blocks registered for prefix caching
    # (`BlockManager.register_full_blocks`).
    prefix_keys: list[PrefixKey] = field(default_factory=list)
    # Cached positions the next pass copies into the request's own block before it runs:
    # (source block, destination block, positions) (`BlockManager.allocate`).
    prefix_copy: tuple[int, int, int] | None = None
    cached_prompt_tokens: int | None = None  # prompt tokens reused at first admission
    draft_cached: int = 0  # positions a second-model drafter has cached
    target_passes: int = 0  # forward passes of the target that gave this request tokens
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_pause: int = 0  # steps left without drafts (`record_verification`)
    draft_backoff: int = 0  # the pause after the next pass that accepts no draft
    preemptions: int = 0  # times the scheduler took its blocks back (recomputed later)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "error" or "abort"
    error: str | None = None
    # With options.prompt_logprobs: the prompt's scores so far, None first (position 0
    # has none).
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def arrival(self) -> float:
        """When the request arrived (`RequestOptions.arrival`, set by `Engine.add_request`)."""
        if self.options.arrival is None:
            raise ValueError(f"request {self.id}: its options have no arrival")
        return self.options.arrival

    @property
    def params(self) -> SamplingParams:
        """The request's parameters, its seed resolved (kept by the logits stage)."""
        return self.logits_state.params

    @property
    def output_ids(self) -> list[int]:
        return self.stop_checker.token_ids

    @property
    def length(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt_ids) + len(self.stop_checker.token_ids)

    def new_tokens(self) -> list[int]:
        """Tokens the next pass runs through the model: what the cache lacks of
        prompt + output (the prompt at first, then the last token; everything
        again after a preemption)."""
        return (self.prompt_ids + self.output_ids)[self.num_cached :]

    def scheduled_tokens(self) -> list[int]:
        """The tokens the next pass runs: `new_tokens()`, cut to `num_scheduled`."""
        return self.new_tokens()[: self.num_scheduled]

    @property
    def samples(self) -> bool:
        """Whether the next pass reaches the sequence's last token, whose logits choose
        the next token; False for a prompt chunk with more of the prompt after it."""
        return self.num_cached + self.num_scheduled >= self.length

    def prompt_positions(self) -> range:
        """Positions whose logits score a prompt token not scored yet: position p scores
        prompt token p + 1 (empty without prompt_logprobs, or once all are scored).
        The prefix cache must not serve these positions (`BlockManager.allocate`)."""
        if self.options.prompt_logprobs is None:
            return range(0)
        return range(len(self.prompt_logprobs) - 1, len(self.prompt_ids) - 1)

    def emit(self, token_id: int, logprobs: TokenLogprobs | None, now: float) -> StreamDelta:
        """Append an emitted token: its time, its logprobs, the logits stage's state, and
        the stop stage, whose answer (text delta, finish reason) is returned."""
        self.token_times.append(now)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self.logits_state.advance(token_id)
        return self.stop_checker.append(token_id)

    # -- speculative decoding: how many drafts to ask for

    def drafts_wanted(self, num_draft: int, max_context: int) -> int:
        """How many drafts this request would take in the coming pass, drafting not
        paused: at most K (its own cap, else the engine's `num_draft`) and what
        max_tokens and the context leave room for (the token after the drafts
        always comes too)."""
        limit = num_draft if self.options.num_draft is None else self.options.num_draft
        count = min(limit, max_context - self.length - 1)
        if self.params.max_tokens is not None:
            count = min(count, self.params.max_tokens - len(self.output_ids) - 1)
        return max(count, 0)

    def record_verification(self, drafted: int, accepted: int) -> None:
        """Count a verification pass's drafts, and draft less while drafts fail.

        A verification pass costs more than a plain step (it runs K + 1
        tokens), so one that accepts nothing is a loss. After such a pass the
        request pauses drafting, twice as long as after the previous one (up
        to MAX_DRAFT_PAUSE steps); each pass that accepts a draft halves the
        pause. The drafting policy only looks at past passes, so the tokens
        keep the target's distribution."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == 0:
            self.draft_backoff = min(max(1, 2 * self.draft_backoff), MAX_DRAFT_PAUSE)
            self.draft_pause = self.draft_backoff
        else:
            self.draft_backoff //= 2


@dataclass(frozen=True)
class Timings:
    """A request's speed, from its arrival and the moments its tokens were emitted.

    - `ttft_s`: time to first token, t_first - arrival (None before any token);
    - `prompt_tokens_per_s`: prompt tokens / ttft_s (None without a token, or if
      ttft_s is 0);
    - `tokens_per_s`: the decode speed, tokens after the first over the time they
      took, (n - 1) / (t_last - t_first); None with fewer than two tokens, or if
      they all came at once (one pass of speculative decoding);
    - `inter_token_latencies_s`: the n - 1 gaps between consecutive tokens.

    Example:
        >>> t = Timings.of(arrival=10.0, token_times=[10.5, 10.75, 11.5], prompt_tokens=4)
        >>> t.ttft_s, t.prompt_tokens_per_s, t.tokens_per_s, t.inter_token_latencies_s
        (0.5, 8.0, 2.0, [0.25, 0.75])
    """

    ttft_s: float | None
    prompt_tokens_per_s: float | None
    tokens_per_s: float | None
    inter_token_latencies_s: list[float]

    @classmethod
    def of(cls, arrival: float, token_times: Sequence[float], prompt_tokens: int) -> Timings:
        times = list(token_times)
        ttft = times[0] - arrival if times else None
        decode_s = times[-1] - times[0] if times else 0.0
        return cls(
            ttft_s=ttft,
            prompt_tokens_per_s=prompt_tokens / ttft if ttft else None,
            tokens_per_s=(len(times) - 1) / decode_s if decode_s > 0 else None,
            inter_token_latencies_s=[b - a for a, b in itertools.pairwise(times)],
        )


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
    preemptions: int = 0
    # Prompt tokens whose keys and values came from the prefix cache at the first
    # admission, not a readmission after preemption (OpenAI's
    # `usage.prompt_tokens_details.cached_tokens`).
    cached_tokens: int = 0
    # prompt_logprobs: per prompt position, None first, then each token's score.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # What computed it: the weights' format, the backend, the decode step's path and
    # the token budget (`Engine.path`).
    path: str | None = None

    @classmethod
    def of(cls, r: Request) -> RequestOutput:
        timing = Timings.of(r.arrival, r.token_times, len(r.prompt_ids))
        return cls(
            request_id=r.id,
            text=r.stop_checker.text,
            token_ids=r.output_ids,
            finish_reason=r.finish_reason,
            seed=r.params.seed,
            prompt_tokens=len(r.prompt_ids),
            completion_tokens=len(r.output_ids),
            ttft_s=timing.ttft_s,
            prompt_tokens_per_s=timing.prompt_tokens_per_s,
            tokens_per_s=timing.tokens_per_s,
            inter_token_latencies_s=timing.inter_token_latencies_s,
            logprobs=r.logprobs if r.params.top_logprobs is not None else None,
            error=r.error,
            draft_tokens=r.drafted,
            accepted_tokens=r.accepted,
            acceptance_rate=r.accepted / r.drafted if r.drafted else None,
            tokens_per_target_pass=len(r.output_ids) / r.target_passes if r.target_passes else None,
            preemptions=r.preemptions,
            cached_tokens=r.cached_prompt_tokens or 0,
            prompt_logprobs=None if r.options.prompt_logprobs is None else list(r.prompt_logprobs),
        )
