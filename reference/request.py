"""What the engine keeps per request and what it hands back: requests, events, outputs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.sampling import SamplingParams
from decodespec.spec.stop import StopChecker

from .block_manager import PrefixKey


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
    num_draft: int | None = None  # this request's cap on drafts per step (None: the engine's)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions whose K/V are in the cache
    # Keys of the leading full blocks registered for prefix caching (`Scheduler.remember`).
    prefix_keys: list[PrefixKey] = field(default_factory=list)
    cached_prompt_tokens: int | None = None  # prompt tokens reused at first admission
    draft_cached: int = 0  # positions a second-model drafter has cached
    target_passes: int = 0  # forward passes of the target that gave this request tokens
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    draft_pause: int = 0  # steps left without drafts (`Speculator.record`)
    draft_backoff: int = 0  # the pause after the next pass that accepts no draft
    preemptions: int = 0  # times the scheduler took its blocks back (recomputed later)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "error" or "abort"
    error: str | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.stop.token_ids

    @property
    def length(self) -> int:
        """Prompt and output tokens so far."""
        return len(self.prompt_ids) + len(self.stop.token_ids)

    def new_tokens(self) -> list[int]:
        """Tokens the next pass runs through the model: what the cache lacks of
        prompt + output (the prompt at first, then the last token; everything
        again after a preemption)."""
        return (self.prompt_ids + self.output_ids)[self.num_cached :]


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

    @classmethod
    def of(cls, r: Request) -> RequestOutput:
        timing = Timings.of(r.arrival, r.token_times, len(r.prompt_ids))
        return cls(
            request_id=r.id,
            text=r.stop.text,
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
        )
