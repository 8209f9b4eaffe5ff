"""The scheduler: which requests run in the next pass, the cache blocks they own,
and what each pass's tokens do to them (postprocess).

Each step, running requests grow first (oldest first) so that their new
tokens have cache slots; when the pool runs dry, the most recently admitted
request is preempted: its blocks go back and it waits, first in line, to be
recomputed (its prompt and output so far prefilled again, as vLLM does). A
running request is never failed for lack of cache. Waiting requests are
admitted only after that, first come first served, while blocks last, and
not in a step that had to preempt. A request that could never fit alone
(prompt + max_tokens beyond the cache) is refused when it is added.

With prefix caching, a request admitted maps the cached blocks that hold the
longest whole-block prefix of its sequence (never its last token, whose
logits it needs) and runs only the rest; after each pass, its newly full
blocks are registered so that later requests can map them
(`block_manager.py`, LOOP-PREFIX-1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_manager import CacheFullError
from .cache import PagedKVCache
from .request import Event, Request
from .runner import Outcome
from .speculation import Speculator


@dataclass(frozen=True)
class Saved:
    """The request state a pass changes before its tokens are kept, to undo a failed pass."""

    num_cached: int
    draft_cached: int
    num_blocks: int
    draft_pause: int
    draft_backoff: int


class Scheduler:
    """Admission, growth, preemption, abort and finishing; `cache` None: no blocks (naive)."""

    def __init__(self, cache: PagedKVCache | None, max_context: int) -> None:
        self.cache = cache
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    def add(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit the cache on its own."""
        if self.cache is not None:
            max_tokens = request.params.max_tokens
            if max_tokens is None:
                max_tokens = self.max_context - len(request.prompt_ids)
            # The last token is never run through the model: it needs no slot.
            positions = len(request.prompt_ids) + max_tokens - 1
            needed = self.cache.blocks_for(positions)
            total = self.cache.allocator.num_blocks
            if needed > total:
                limit = "max_tokens" if request.params.max_tokens is not None else "the context"
                raise ValueError(
                    f"a {len(request.prompt_ids)}-token prompt with up to {max_tokens} new "
                    f"tokens ({limit}) needs {needed} cache blocks of "
                    f"{self.cache.block_size} positions; the cache has {total}: lower "
                    "max_tokens or raise cache_tokens"
                )
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Request]:
        """The requests of the next pass, each with cache blocks for its new tokens."""
        preempted = False
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted to make room for an older one
            while not self.grow(request, request.length):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
        while self.waiting and not preempted:
            if not self.admit(self.waiting[0]):
                break  # it fits once running requests finish
            self.running.append(self.waiting.popleft())
        return list(self.running)

    def admit(self, request: Request) -> bool:
        """Give a waiting request its blocks: the cached ones that hold a prefix of its
        sequence, then new ones for the rest; False (taking none) if they do not fit."""
        if self.cache is None:
            return True
        sequence = request.prompt_ids + request.output_ids
        allocator, size = self.cache.allocator, self.cache.block_size
        # The last token always runs: its logits choose the next token.
        hits, keys = allocator.match_prefix(sequence, size, (len(sequence) - 1) // size)
        allocator.share(hits)  # before allocating, so that no hit is evicted for the rest
        request.blocks = list(hits)
        if not self.grow(request, request.length):
            self._release(request)
            return False
        request.num_cached = len(hits) * size
        request.prefix_keys = keys
        # What the cache served the client's prompt: the first admission's figure. A
        # readmission after preemption maps blocks the request cached itself; not counted.
        if request.cached_prompt_tokens is None:
            request.cached_prompt_tokens = min(request.num_cached, len(request.prompt_ids))
        return True

    def grow(self, request: Request, positions: int) -> bool:
        """Give the request blocks for `positions` positions; False (taking none) if
        the pool has too few free."""
        if self.cache is None:
            return True
        needed = self.cache.blocks_for(positions) - len(request.blocks)
        try:
            request.blocks += self.cache.allocator.allocate(max(0, needed))
        except CacheFullError:
            return False
        return True

    def shrink(self, request: Request, positions: int) -> None:
        """Give back the request's blocks past its first `positions` positions."""
        if self.cache is None:
            return
        keep = self.cache.blocks_for(positions)
        if len(request.blocks) > keep:
            self.cache.allocator.free(request.blocks[keep:])
            del request.blocks[keep:]

    def roll_back(self, request: Request) -> None:
        """Forget rejected drafts: the cache keeps the emitted sequence's positions
        only (its last token runs next step), and blocks past them go back."""
        request.num_cached = min(request.num_cached, request.length - 1)
        request.draft_cached = min(request.draft_cached, request.num_cached)
        self.shrink(request, request.length)

    @staticmethod
    def save(request: Request) -> Saved:
        r = request
        return Saved(r.num_cached, r.draft_cached, len(r.blocks), r.draft_pause, r.draft_backoff)

    def restore(self, request: Request, saved: Saved) -> None:
        """Undo a failed pass: the request's cache positions, drafting state and blocks."""
        request.num_cached, request.draft_cached = saved.num_cached, saved.draft_cached
        request.draft_pause, request.draft_backoff = saved.draft_pause, saved.draft_backoff
        if self.cache is not None:
            self.shrink(request, saved.num_blocks * self.cache.block_size)

    def preempt(self, request: Request) -> None:
        """Take the request's blocks back; it waits first in line and is recomputed."""
        self.running.remove(request)
        self._release(request)
        request.num_cached = request.draft_cached = 0
        request.preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a running or waiting request; its blocks go back at once."""
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)

    def _release(self, request: Request) -> None:
        if self.cache is not None and request.blocks:
            self.cache.allocator.free(request.blocks)
        request.blocks = []
        request.prefix_keys = []

    def remember(self, request: Request, written: int) -> None:
        """Register the request's full blocks within its first `written` positions
        (all computed from its own tokens) for prefix caching."""
        if self.cache is None or not self.cache.allocator.prefix_caching:
            return
        size = self.cache.block_size
        sequence = request.prompt_ids + request.output_ids
        for i in range(len(request.prefix_keys), written // size):
            parent = request.prefix_keys[-1] if request.prefix_keys else None
            tokens = sequence[i * size : (i + 1) * size]
            request.prefix_keys.append(
                self.cache.allocator.register(request.blocks[i], parent, tokens)
            )

    def postprocess(self, request: Request, outcome: Outcome, now: float) -> list[Event]:
        """Append a pass's tokens to the request, up to the first that finishes it, and
        return its events; then give back the blocks of rejected drafts."""
        if outcome.error is not None:
            return [self.fail(request, outcome.error)]
        # Positions before the tokens this pass emits hold the keys and values of the
        # request's own tokens; any after them are drafts', which may be rejected.
        self.remember(request, min(request.num_cached, request.length))
        request.target_passes += 1
        if outcome.drafted:
            Speculator.record(request, outcome.drafted, accepted=len(outcome.tokens) - 1)
        events = []
        try:
            for token, logprobs, candidates in zip(
                outcome.tokens, outcome.logprobs, outcome.candidates, strict=True
            ):
                request.token_times.append(now)
                if logprobs is not None:
                    request.logprobs.append(logprobs)
                delta = request.stop.append(token)
                events.append(
                    Event(request.id, token, delta.text, delta.finish_reason, logprobs, candidates)
                )
                if delta.finish_reason is not None:
                    # A stop inside an accepted run cuts it: the later tokens are dropped.
                    self.finish(request, delta.finish_reason)
                    return events
        except Exception as error:
            return [*events, self.fail(request, f"{type(error).__name__}: {error}")]
        self.roll_back(request)
        return events

    def fail(self, request: Request, message: str) -> Event:
        """Finish the request with reason "error" and the message."""
        request.error = message
        self.finish(request, "error")
        return Event(request.id, None, "", "error", error=message)
