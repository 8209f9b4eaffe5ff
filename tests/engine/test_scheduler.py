"""The scheduler's own contract, on requests and a block manager alone (no model):
admission first come first served, growth before admission, preemption of the
most recently admitted, draft slots, and postprocess applying a pass's outcome
(the scheduler is the one writer of a request's cache positions after a pass).

The waiting order, in a section of its own, runs an Engine with a small random
model: a preempted request waits first in line, so no request that arrived
earlier or later is admitted before it, and requests preempted in one step keep
the order of their admission.
"""

from __future__ import annotations

import pytest

from decodespec.reference.block_manager import BlockManager
from decodespec.reference.engine import Engine
from decodespec.reference.logits_state import LogitsState
from decodespec.reference.request import PassOutcome, Request
from decodespec.reference.request_options import RequestOptions
from decodespec.reference.scheduler import Scheduler
from decodespec.spec.params import SamplingParams
from decodespec.spec.stop import StopChecker
from tests.engine.toy import (
    ByteTokenizer,
    greedy,
    random_weights,
    record_admissions,
    run_to_end,
    small_config,
)

MAX_CONTEXT = 64
EOS = 0


def request(id: int, prompt_len: int, max_tokens: int = 8, num_draft: int | None = None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, seed=1)
    prompt = list(range(1, prompt_len + 1))
    return Request(
        id=id,
        prompt_ids=prompt,
        stop_checker=StopChecker(
            params,
            eos_token_ids=[EOS],
            token_bytes=lambda t: bytes([97 + t % 26]),
            prompt_len=prompt_len,
            max_context=MAX_CONTEXT,
        ),
        logits_state=LogitsState(params, prompt),
        options=RequestOptions(arrival=0.0, num_draft=num_draft),
    )


def scheduler(
    num_blocks: int,
    block_size: int = 4,
    num_draft: int = 0,
    token_budget: int | None = None,
    long_prompt_chunk: int | None = None,
    long_prompt_interval: int = 1,
) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), MAX_CONTEXT, num_draft, token_budget,
                     long_prompt_chunk, long_prompt_interval)  # fmt: skip


def step(s: Scheduler, tokens: int = 7) -> list[Request]:
    """One pass in which every scheduled request caches its sequence and emits `tokens`."""
    batch = s.schedule()
    for r in batch:
        s.postprocess(r, PassOutcome(tokens=[tokens], logprobs=[None], candidates=[None],
                                     num_cached=r.length), now=0.0)  # fmt: skip
    return batch


def chunked_step(s: Scheduler) -> list[tuple[int, int]]:
    """One pass that caches what each request was scheduled to run; a request whose
    pass reaches its sequence's end emits a token. Returns (id, tokens run) of each."""
    batch = s.schedule()
    for r in batch:
        tokens = [7] if r.samples else []
        outcome = PassOutcome(tokens=tokens, logprobs=[None] * len(tokens),
                              candidates=[None] * len(tokens),
                              num_cached=r.num_cached + r.num_scheduled)  # fmt: skip
        s.postprocess(r, outcome, now=0.0)
    return [(r.id, r.num_scheduled) for r in batch]


def test_requests_are_admitted_first_come_first_served_while_blocks_last():
    s = scheduler(num_blocks=4)  # 16 positions
    a, b, c = request(0, 6), request(1, 6), request(2, 6)
    for r in (a, b, c):
        s.add(r)
    assert s.schedule() == [a, b]  # 2 blocks each; c waits
    assert list(s.waiting) == [c]


def test_the_most_recently_admitted_request_is_preempted_and_waits_first_in_line():
    s = scheduler(num_blocks=4)
    a, b = request(0, 8), request(1, 8)
    s.add(a)
    s.add(b)
    assert step(s) == [a, b]  # 8 prompt positions each: 2 blocks each, the pool full
    batch = s.schedule()  # a's 9th position needs a third block: b goes back
    assert batch == [a]
    assert (b.preemptions, b.num_cached, b.blocks) == (1, 0, [])
    assert list(s.waiting) == [b]


def test_postprocess_applies_the_outcome_and_rolls_back_to_the_emitted_sequence():
    s = scheduler(num_blocks=8)
    r = request(0, 5)
    s.add(r)
    assert s.schedule() == [r]
    assert r.num_cached == 0
    # A verification pass wrote 5 prompt positions and 2 drafts; one draft was kept.
    s.postprocess(r, PassOutcome(tokens=[9, 10], logprobs=[None] * 2, candidates=[None] * 2,
                                 drafted=2, num_cached=7), now=0.0)  # fmt: skip
    assert r.output_ids == [9, 10]
    assert r.num_cached == r.length - 1 == 6  # the last token runs next pass
    assert (r.drafted, r.accepted) == (2, 1)


def test_a_failed_outcome_fails_the_request_and_changes_nothing_else():
    s = scheduler(num_blocks=8)
    r = request(0, 5)
    s.add(r)
    s.schedule()
    (out,) = s.postprocess(r, PassOutcome(error="RuntimeError: boom", num_cached=5), now=0.0)
    assert (out.finish_reason, out.error) == ("error", "RuntimeError: boom")
    assert (r.num_cached, r.output_ids, r.blocks) == (0, [], [])
    assert not s.has_unfinished()


@pytest.mark.parametrize(("max_tokens", "want"), [(8, 3), (3, 2), (1, 0)])
def test_draft_slots_are_what_max_tokens_leaves_room_for(max_tokens, want):
    s = scheduler(num_blocks=8, num_draft=3)
    r = request(0, 5, max_tokens=max_tokens)
    s.add(r)
    s.schedule()
    assert r.draft_slots == want


def test_a_paused_request_takes_no_drafts_and_its_pause_passes():
    s = scheduler(num_blocks=8, num_draft=3)
    r = request(0, 5)
    r.draft_pause = 2
    s.add(r)
    s.schedule()
    assert (r.draft_slots, r.draft_pause) == (0, 1)
    assert r.drafts_wanted(3, MAX_CONTEXT) == 3  # asking does not change the request
    assert r.draft_pause == 1


# ---------------------------------------------------------------- the waiting order


@pytest.fixture(scope="module")
def model():
    return random_weights(small_config(), seed=5)


def waiting_ids(engine: Engine) -> list[int]:
    return [r.id for r in engine.scheduler.waiting]


def test_a_preempted_request_waits_ahead_of_requests_that_arrived_before(model):
    """A and B run, C waits (it does not fit); B is preempted: the queue is [B, C],
    and B is readmitted before C, although C had waited longer."""
    # 10 blocks of 1 position: A and B (4-token prompts) and C cannot all run.
    engine = Engine(model, ByteTokenizer(), block_size=1, cache_tokens=10, prefix_caching=False)
    admissions = record_admissions(engine)
    a = engine.add_request([10, 11, 12, 13], greedy(6))
    b = engine.add_request([20, 21, 22, 23], greedy(6))
    c = engine.add_request([30, 31, 32, 33], greedy(1))
    waiting = []
    for _ in range(3):
        engine.step()
        waiting.append(waiting_ids(engine))
    assert [i for i, _ in admissions] == [a, b]
    assert engine.output(b).preemptions == 1, "precondition: B is preempted in step 3"
    assert waiting == [[c], [c], [b, c]]
    d = engine.add_request([40], greedy(1))  # arrives after the preemption: behind both
    assert waiting_ids(engine) == [b, c, d]
    run_to_end(engine)
    assert [i for i, _ in admissions] == [a, b, b, c, d]
    assert [engine.output(i).finish_reason for i in (a, b, c, d)] == ["length"] * 4


def test_requests_preempted_in_one_step_keep_their_admission_order(model):
    """A, B, C run and D joins last; in one step A's growth preempts D and B's preempts
    C. The queue is [C, D, E] (E arrived before the preemptions), and C is readmitted
    before D, both before E."""
    # 16 blocks of 1 position: A, B, C (4-token prompts) and D (1 token) fill them in step 2.
    engine = Engine(model, ByteTokenizer(), block_size=1, cache_tokens=16, prefix_caching=False)
    admissions = record_admissions(engine)
    a, b, c = (engine.add_request([10 * k, 1, 2, 3], greedy(3)) for k in (1, 2, 3))
    engine.step()
    d = engine.add_request([40], greedy(4))
    engine.step()
    e = engine.add_request(list(range(50, 60)), greedy(2))  # does not fit: it waits
    assert [i for i, _ in admissions] == [a, b, c, d] and waiting_ids(engine) == [e]

    engine.step()
    assert [engine.output(i).preemptions for i in (a, b, c, d)] == [0, 0, 1, 1], (
        "precondition: C and D are preempted in the same step"
    )
    assert waiting_ids(engine) == [c, d, e]
    run_to_end(engine)
    assert [i for i, _ in admissions] == [a, b, c, d, c, d, e]


# ---------------------------------------------------------------- chunked prefill


def test_decoding_requests_run_first_and_a_long_prompt_takes_what_the_budget_leaves():
    s = scheduler(num_blocks=16, token_budget=8)
    a, b = request(0, 3), request(1, 20)
    s.add(a)
    assert chunked_step(s) == [(0, 3)]  # a's prompt whole; a emits its first token
    s.add(b)
    # a decodes every pass; b's prompt comes in chunks of what a leaves of the budget.
    assert [chunked_step(s) for _ in range(3)] == [[(0, 1), (1, 7)]] * 2 + [[(0, 1), (1, 6)]]
    assert (len(a.output_ids), len(b.output_ids)) == (4, 1)  # b's first token: its last chunk
    assert b.num_cached == 20
    assert chunked_step(s) == [(0, 1), (1, 1)]


def test_a_long_prompt_takes_its_small_chunks_only_while_others_decode():
    """A prompt longer than the budget takes `long_prompt_chunk` tokens a pass beside
    decoding requests, the budget's worth once none decodes; a short prompt that
    arrives meanwhile is not capped."""
    s = scheduler(num_blocks=24, token_budget=8, long_prompt_chunk=2)
    a, b, c = request(0, 3, max_tokens=3), request(1, 20), request(2, 5)
    s.add(a)
    assert chunked_step(s) == [(0, 3)]
    s.add(b)
    assert chunked_step(s) == [(0, 1), (1, 2)]  # b is long, and a decodes
    s.add(c)
    assert chunked_step(s) == [(0, 1), (1, 2), (2, 5)]  # c is short: whole
    assert len(a.output_ids) == 3 and a.finish_reason == "length"
    # a has finished; c decodes, so b still takes 2 a pass
    assert chunked_step(s) == [(1, 2), (2, 1)]
    s.finish(c, "abort")
    assert chunked_step(s) == [(1, 8)]  # nobody decodes: the budget's worth
    assert chunked_step(s) == [(1, 6)]
    assert (b.num_cached, len(b.output_ids)) == (20, 1)


def test_a_long_prompt_takes_a_chunk_in_one_pass_of_every_interval():
    """Beside decoding requests, a long prompt takes `long_prompt_chunk` tokens in one
    pass of every `long_prompt_interval`, the first at once, and none in the passes
    between; once none decodes, the budget's worth every pass."""
    s = scheduler(num_blocks=24, token_budget=8, long_prompt_chunk=3, long_prompt_interval=3)
    a, b = request(0, 3, max_tokens=8), request(1, 20)
    s.add(a)
    assert chunked_step(s) == [(0, 3)]
    s.add(b)
    with_chunk, without = [(0, 1), (1, 3)], [(0, 1)]
    assert [chunked_step(s) for _ in range(7)] == [with_chunk, without, without] * 2 + [with_chunk]
    assert a.finish_reason == "length" and b.num_cached == 9
    assert [chunked_step(s) for _ in range(2)] == [[(1, 8)], [(1, 3)]]  # nobody decodes
    assert (b.num_cached, len(b.output_ids)) == (20, 1)


def test_a_pass_the_budget_leaves_nothing_to_is_not_a_long_prompts_turn():
    """With the budget all taken by decoding requests, a long prompt waits without
    spending its turn: it takes its chunk in the first pass that has room."""
    s = scheduler(num_blocks=24, token_budget=2, long_prompt_chunk=1, long_prompt_interval=2)
    a, b, c = request(0, 1, max_tokens=4), request(1, 1, max_tokens=4), request(2, 12)
    s.add(a)
    assert chunked_step(s) == [(0, 1)]
    s.add(c)
    assert chunked_step(s) == [(0, 1), (2, 1)]
    s.add(b)
    assert chunked_step(s) == [(0, 1), (1, 1)]  # c's pass off
    assert chunked_step(s) == [(0, 1), (1, 1)]  # a and b take the whole budget
    assert a.finish_reason == "length" and c.num_cached == 1
    assert chunked_step(s) == [(2, 1), (1, 1)]  # room for one: c's turn at once
    assert chunked_step(s) == [(1, 1)]
    assert b.finish_reason == "length"
    assert chunked_step(s) == [(2, 2)]


def test_a_prompt_chunk_emits_nothing_and_takes_no_drafts():
    s = scheduler(num_blocks=16, num_draft=3, token_budget=4)
    r = request(0, 6)
    s.add(r)
    batch = s.schedule()
    assert (batch, r.num_scheduled, r.samples, r.draft_slots) == ([r], 4, False, 0)
    assert r.scheduled_tokens() == [1, 2, 3, 4]
    assert s.postprocess(r, PassOutcome(num_cached=4), now=0.0) == []
    assert (r.num_cached, r.output_ids, r.target_passes) == (4, [], 0)
    s.schedule()
    assert (r.num_scheduled, r.samples, r.draft_slots) == (2, True, 3)


def test_new_requests_are_admitted_only_while_the_budget_lasts():
    s = scheduler(num_blocks=16, token_budget=4)
    a, b = request(0, 6), request(1, 6)
    s.add(a)
    s.add(b)
    assert chunked_step(s) == [(0, 4)]
    assert (list(s.waiting), b.blocks) == ([b], [])  # no blocks held without running
    assert chunked_step(s) == [(0, 2), (1, 2)]
    assert chunked_step(s) == [(0, 1), (1, 3)]
    assert chunked_step(s) == [(0, 1), (1, 1)]


def test_without_a_budget_every_prompt_runs_whole():
    s = scheduler(num_blocks=16)
    a, b = request(0, 9), request(1, 20)
    s.add(a)
    s.add(b)
    assert chunked_step(s) == [(0, 9), (1, 20)]
