"""The scheduler: which requests run in the next pass, and what each pass's tokens
do to them (postprocess). It sees requests and the block manager, nothing else.

Each step, running requests grow first (oldest first) so that their new
tokens have cache slots; when the pool runs dry, the most recently admitted
request is preempted: its blocks go back and it waits, first in line, to be
recomputed (its prompt and output so far prefilled again, as vLLM does). A
running request is never failed for lack of cache. Waiting requests are
admitted only after that, first come first served, while blocks last, and
not in a step that had to preempt. A request that could never fit alone
(prompt + max_tokens beyond the cache) is refused when it is added. With
speculative decoding, each request then gets slots for the drafts it will
take this pass, if the pool has them (vLLM's lookahead slots), else none.

Chunked prefill (vLLM's `max_num_batched_tokens`): a pass runs about
`token_budget` tokens. Decoding requests come first, one token each (and
the drafts they take, outside the budget), then the prompts under way,
oldest first, then new admissions, each prompt taking a chunk of what the
budget has left; a request is admitted only while some is left. A
chunk that stops short of the sequence's end yields no token: its logits
are not even computed, and the next pass continues from the positions it
cached (a cached prefix, LOOP-PREFIX-1). So one long prompt, or many new
ones, never stalls the requests already decoding, and short prompts get
their first token without waiting for a long one before them.

A long prompt (more new tokens when admitted than the budget) takes at most
`long_prompt_chunk` tokens, in one pass of every `long_prompt_interval`, while
other requests decode; the whole budget's worth every pass otherwise (vLLM's
`long_prefill_token_threshold` caps a long prompt's chunk likewise). On a CPU
every prompt token a pass runs is time the decoding requests wait for their
next token, and a pass with any of a long prompt's tokens also attends over
its whole context so far: a chunk of 64 every 12 passes costs them less than
one of 8 every pass, for the same progress. Short prompts are not capped: a
burst of chats still gets its first tokens in a pass or two.

With prefix caching, a request admitted maps the cached blocks that hold the
longest prefix of its sequence (never its last token, whose logits it needs)
and runs only the rest; after each pass, its newly full blocks are
registered so that later requests can map them (`block_manager.py`,
LOOP-PREFIX-1). A waiting request whose prompt begins like one this pass
prefills, for at least a block of positions the pass computes, waits for
the next pass and maps them then instead of computing them too (SGLang's
in-batch prefix caching): sixteen chats that arrive together with one
system prompt prefill it once, not sixteen times. It keeps its place in
line; requests behind it that share nothing are admitted meanwhile.
"""

from __future__ import annotations

from collections import deque

from .block_manager import BlockManager, NaiveBlockManager
from .request import PassOutcome, Request, RequestStepOutput


class Scheduler:
    """Admission, growth, preemption, prompt chunks, draft slots, abort and finishing.

    `num_draft` is the engine's K, the most drafts per request and pass (0:
    no speculative decoding). `token_budget` bounds the tokens of a pass (see
    the module docstring); None runs every prompt whole. `long_prompt_chunk`
    bounds a long prompt's chunk while others decode (None: the budget's), which
    it takes in one pass of every `long_prompt_interval`.
    """

    def __init__(
        self,
        blocks: BlockManager | NaiveBlockManager,
        max_context: int,
        num_draft: int = 0,
        token_budget: int | None = None,
        long_prompt_chunk: int | None = None,
        long_prompt_interval: int = 1,
    ) -> None:
        self.blocks = blocks
        self.max_context = max_context
        self.num_draft = num_draft
        self.token_budget = token_budget
        self.long_prompt_chunk = long_prompt_chunk
        self.long_prompt_interval = long_prompt_interval
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first

    def add(self, request: Request) -> None:
        """Queue a request; ValueError if it could never fit the cache on its own."""
        max_tokens = request.params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_context - len(request.prompt_ids)
        limit = "max_tokens" if request.params.max_tokens is not None else "the context"
        self.blocks.check_fits(request, max_tokens, limit)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Request]:
        """The requests of the next pass, each with cache blocks for its new tokens,
        `num_scheduled` (how many of them the pass runs) and `draft_slots` (the
        drafts it may take)."""
        preempted = self._grow_running()
        decoding = [r for r in self.running if len(r.new_tokens()) == 1]
        prefilling = [r for r in self.running if len(r.new_tokens()) > 1]
        # Decoding requests first, one token each: a long prompt never stalls them.
        left = None if self.token_budget is None else self.token_budget - len(decoding)
        for request in decoding:
            request.num_scheduled = 1
        for request in prefilling:  # prompts under way, oldest first
            left = self._schedule_chunk(request, left, bool(decoding))
        deferred: list[Request] = []  # waiting for a prefix this pass computes
        while self.waiting and not preempted and (left is None or left > 0):
            if self._prefix_in_this_pass(self.waiting[0]):
                deferred.append(self.waiting.popleft())
                continue
            if not self.admit(self.waiting[0]):
                break  # it fits once running requests finish
            request = self.waiting.popleft()
            self.running.append(request)
            left = self._schedule_chunk(request, left, bool(decoding))
        self.waiting.extendleft(reversed(deferred))
        batch = [r for r in self.running if r.num_scheduled > 0]
        for request in batch:
            request.draft_slots = self._draft_slots(request) if request.samples else 0
        return batch

    def _grow_running(self) -> bool:
        """Give every running request blocks for its whole sequence, preempting the
        most recently admitted while the pool runs dry; whether any was preempted."""
        preempted = False
        for request in list(self.running):
            if request not in self.running:
                continue  # preempted to make room for an older one
            while not self.blocks.grow(request, request.length):
                victim = self.running[-1]
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
        return preempted

    def _prefix_in_this_pass(self, waiting: Request) -> bool:
        """Whether a request of this pass computes at least a block of positions that
        begin the waiting request's prompt (which it could map after the pass)."""
        if not self.blocks.reuses_prefixes:
            return False
        prompt = waiting.prompt_ids
        for request in self.running:
            start, end = request.num_cached, request.num_cached + request.num_scheduled
            if request.num_scheduled == 0 or end - start < self.blocks.block_size:
                continue
            shared = _common_prefix(prompt, request.prompt_ids, end)
            if shared - start >= self.blocks.block_size:
                return True
        return False

    def _schedule_chunk(
        self, request: Request, left: int | None, others_decode: bool
    ) -> int | None:
        """Schedule what `left` tokens of the budget allow of the request's new tokens
        (all of them without a budget), a long prompt's `long_prompt_chunk` at most,
        in one pass of every `long_prompt_interval`, while others decode; the budget
        left after it."""
        wanted = len(request.new_tokens())
        if left is not None:
            wanted = min(wanted, max(left, 0))
        if others_decode and request.long_prompt and self.long_prompt_chunk is not None:
            if request.long_prompt_wait > 0:
                request.long_prompt_wait -= 1
                wanted = 0
            else:
                wanted = min(wanted, self.long_prompt_chunk)
                if wanted:  # a pass the budget left nothing for is not its turn
                    request.long_prompt_wait = self.long_prompt_interval - 1
        request.num_scheduled = wanted
        return None if left is None else left - wanted

    def admit(self, request: Request) -> bool:
        """Give a waiting request its blocks (mapping a cached prefix); False, taking
        none, if they do not fit."""
        if not self.blocks.allocate(request):
            return False
        budget = self.token_budget
        request.long_prompt = budget is not None and len(request.new_tokens()) > budget
        request.long_prompt_wait = 0  # its first chunk in its first pass
        # What the cache served the client's prompt: the first admission's figure. A
        # readmission after preemption maps blocks the request cached itself; not counted.
        if request.cached_prompt_tokens is None:
            request.cached_prompt_tokens = min(request.num_cached, len(request.prompt_ids))
        return True

    def _draft_slots(self, request: Request) -> int:
        """How many drafts the request takes this pass: none while its drafting is
        paused (a step of the pause passes), else what it asks for
        (`Request.drafts_wanted`) if its blocks can grow to hold them, else none
        (this pass is then plain decoding for it)."""
        if not self.num_draft:
            return 0
        if request.draft_pause > 0:
            request.draft_pause -= 1
            return 0
        count = request.drafts_wanted(self.num_draft, self.max_context)
        if count > 0 and not self.blocks.grow(request, request.length + count):
            return 0
        return count

    def preempt(self, request: Request) -> None:
        """Take the request's blocks back; it waits first in line and is recomputed."""
        self.running.remove(request)
        self.blocks.free(request)
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
        self.blocks.free(request)

    # -- after a pass

    def postprocess(
        self, request: Request, outcome: PassOutcome, now: float
    ) -> list[RequestStepOutput]:
        """Apply a pass's outcome: the cache positions it wrote, then its tokens, up to
        the first that finishes the request, whose outputs are returned; then give
        back the blocks of rejected drafts."""
        self.blocks.copied(request)  # the pass made it before running, failed or not
        if outcome.error is not None:
            return [self.fail(request, outcome.error)]
        if outcome.num_cached is not None:
            request.num_cached = outcome.num_cached
        if outcome.draft_cached is not None:
            request.draft_cached = outcome.draft_cached
        # Positions before the tokens this pass emits hold the keys and values of the
        # request's own tokens; any after them are drafts', which may be rejected.
        self.blocks.register_full_blocks(request, min(request.num_cached, request.length))
        request.prompt_logprobs += outcome.prompt_logprobs
        if outcome.tokens:  # not a prompt chunk's pass
            request.target_passes += 1
        if outcome.drafted:
            request.record_verification(outcome.drafted, accepted=len(outcome.tokens) - 1)
        outputs = []
        try:
            for token, logprobs, candidates in zip(
                outcome.tokens, outcome.logprobs, outcome.candidates, strict=True
            ):
                first = request.options.prompt_logprobs is not None and not request.output_ids
                delta = request.emit(token, logprobs, now)
                outputs.append(
                    RequestStepOutput(
                        token_id=token,
                        text=delta.text,
                        finish_reason=delta.finish_reason,
                        logprobs=logprobs,
                        request_id=request.id,
                        candidates=candidates,
                        prompt_logprobs=list(request.prompt_logprobs) if first else None,
                    )
                )
                if delta.finish_reason is not None:
                    # A stop inside an accepted run cuts it: the later tokens are dropped.
                    self.finish(request, delta.finish_reason)
                    return outputs
        except Exception as error:
            return [*outputs, self.fail(request, f"{type(error).__name__}: {error}")]
        self.roll_back(request)
        return outputs

    def roll_back(self, request: Request) -> None:
        """Forget rejected drafts: the cache keeps the emitted sequence's positions
        only (its last token runs next step), and blocks past them go back."""
        request.num_cached = min(request.num_cached, request.length - 1)
        request.draft_cached = min(request.draft_cached, request.num_cached)
        self.blocks.shrink(request, request.length)

    def fail(self, request: Request, message: str) -> RequestStepOutput:
        """Finish the request with reason "error" and the message."""
        request.error = message
        self.finish(request, "error")
        return RequestStepOutput(
            token_id=None, text="", finish_reason="error", request_id=request.id, error=message
        )


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, counting at most `limit`."""
    count = 0
    for x, y in zip(a[:limit], b[:limit], strict=False):
        if x != y:
            break
        count += 1
    return count
