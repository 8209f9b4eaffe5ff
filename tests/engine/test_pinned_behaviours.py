"""Behaviours the rest of the suite let slip (issue 26), each pinned by a test that
fails when it breaks:

- a preempted and readmitted request reports the prompt tokens the prefix cache
  served at its *first* admission, never the blocks it cached for itself before
  it was preempted;
- a preempted request waits first in line: no request that arrived earlier or
  later is admitted before it, and requests preempted in one step keep the order
  of their admission;
- the timings are exactly TTFT = t_first - arrival, prompt tokens / TTFT and
  (n - 1) / (t_last - t_first), for token times set by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decodespec.reference import engine as engine_module
from decodespec.reference.completions_format import usage
from decodespec.reference.engine import Engine
from decodespec.reference.request import Timings
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.params import SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config


@pytest.fixture(scope="module")
def model():
    return random_weights(small_config(), seed=5)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def record_admissions(engine: Engine) -> list[tuple[int, int]]:
    """(request id, positions mapped from the prefix cache) of every admission that
    succeeds, in order; admissions that do not fit are left out."""
    log: list[tuple[int, int]] = []
    admit = engine.scheduler.admit

    def recording_admit(request):
        admitted = admit(request)
        if admitted:
            log.append((request.id, request.num_cached))
        return admitted

    engine.scheduler.admit = recording_admit
    return log


def waiting_ids(engine: Engine) -> list[int]:
    return [r.id for r in engine.scheduler.waiting]


def run_to_end(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


# ---------------------------------------------------------------- cached_tokens


SYSTEM = list(range(40, 48))  # two full blocks of 4
OWN = [1, 2, 3, 4, 5, 6]  # A's prompt: SYSTEM + OWN, 14 tokens


@pytest.mark.clause("LOOP-PREFIX-1")
@pytest.mark.parametrize("first_hit", [8, 0], ids=["prefix-hit", "no-hit"])
def test_cached_tokens_of_a_readmitted_request_are_its_first_admissions(model, first_hit):
    """A maps SYSTEM's two blocks from the cache (or nothing, when no earlier request
    left them), generates until its own blocks are full and registered, is preempted
    by the older B, and is readmitted after B ends, mapping 16 positions of its own
    blocks. Its cached_tokens (output, Request, OpenAI usage) stay the first figure."""
    # 8 blocks of 4: B (6 + up to 8 tokens) and A (14 + up to 10) need 10 blocks at 7
    # tokens each, so B's growth preempts A (the later admitted), then B ends.
    engine = Engine(model, ByteTokenizer(), block_size=4, cache_tokens=32)
    if first_hit:  # leave SYSTEM's two blocks in the prefix cache
        engine.add_request([*SYSTEM, 9], greedy(1))
        run_to_end(engine)
    admissions = record_admissions(engine)
    b = engine.add_request([7, 7, 7, 8, 8, 8], greedy(8))
    a = engine.add_request(SYSTEM + OWN, greedy(10))
    run_to_end(engine)

    # Preconditions: A was preempted once, and its recompute reused its own blocks
    # (more positions than its first admission mapped, and the whole prompt).
    assert engine.output(a).preemptions == 1 and engine.output(b).preemptions == 0
    assert [n for i, n in admissions if i == a] == [first_hit, 16]
    assert engine.output(a).finish_reason == "length" and engine.output(a).completion_tokens == 10

    assert engine.requests[a].cached_prompt_tokens == first_hit
    assert engine.output(a).cached_tokens == first_hit
    assert usage(engine.output(a))["prompt_tokens_details"]["cached_tokens"] == first_hit
    assert engine.output(b).cached_tokens == 0


# ---------------------------------------------------------------- the waiting order


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


# ---------------------------------------------------------------- timings


def test_timings_from_hand_set_times():
    t = Timings.of(arrival=100.0, token_times=[100.5, 100.75, 101.25, 102.5], prompt_tokens=6)
    assert t.ttft_s == 0.5
    assert t.prompt_tokens_per_s == 6 / 0.5
    assert t.tokens_per_s == 3 / 2.0  # (n - 1) / (t_last - t_first)
    assert t.inter_token_latencies_s == [0.25, 0.5, 1.25]
    # Times that are not dyadic: exactly the formula, not a sum of rounded gaps.
    times = [0.1, 0.3, 0.7, 1.1, 1.3]
    t = Timings.of(arrival=0.0, token_times=times, prompt_tokens=7)
    assert t.ttft_s == 0.1 and t.prompt_tokens_per_s == 7 / 0.1
    assert t.tokens_per_s == 4 / (1.3 - 0.1)


def test_timings_with_one_token_or_none():
    one = Timings.of(arrival=3.0, token_times=[3.25], prompt_tokens=5)
    assert (one.ttft_s, one.prompt_tokens_per_s) == (0.25, 20.0)
    assert one.tokens_per_s is None and one.inter_token_latencies_s == []  # no decode yet
    none = Timings.of(arrival=3.0, token_times=[], prompt_tokens=5)
    assert none == Timings(None, None, None, [])
    # All tokens at one moment (one pass of speculative decoding), or a first token
    # at the arrival's own moment: no rate rather than a division by zero.
    burst = Timings.of(arrival=1.0, token_times=[2.0, 2.0, 2.0], prompt_tokens=5)
    assert burst.tokens_per_s is None and burst.inter_token_latencies_s == [0.0, 0.0]
    instant = Timings.of(arrival=2.0, token_times=[2.0, 2.5], prompt_tokens=5)
    assert instant.ttft_s == 0.0 and instant.prompt_tokens_per_s is None
    assert instant.tokens_per_s == 2.0


@pytest.mark.parametrize("max_tokens", [4, 1])
def test_the_engine_reports_the_timings_of_its_clock(model, monkeypatch, max_tokens):
    """The engine stamps each token with the step's clock reading and measures TTFT
    from the request's arrival: `output` gives the timings of those moments."""
    step_times = iter([100.25, 100.5, 101.0, 102.0])  # one reading per step
    clock = SimpleNamespace(perf_counter=lambda: next(step_times))
    monkeypatch.setattr(engine_module, "time", clock)
    engine = Engine(model, ByteTokenizer())
    rid = engine.add_request([1, 2, 3, 4, 5], greedy(max_tokens), RequestOptions(arrival=100.0))
    run_to_end(engine)
    out = engine.output(rid)
    assert engine.requests[rid].token_times == [100.25, 100.5, 101.0, 102.0][:max_tokens]
    assert out.ttft_s == 0.25 and out.prompt_tokens_per_s == 5 / 0.25
    if max_tokens == 1:
        assert out.tokens_per_s is None and out.inter_token_latencies_s == []
    else:
        assert out.tokens_per_s == 3 / 1.75
        assert out.inter_token_latencies_s == [0.25, 0.5, 1.0]
