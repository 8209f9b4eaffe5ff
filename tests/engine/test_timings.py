"""A request's timings: TTFT = t_first - arrival, prompt tokens / TTFT and
(n - 1) / (t_last - t_first), exactly, for token times set by hand, and the engine
reports the timings of its own clock's readings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from decodespec.reference import engine as engine_module
from decodespec.reference.engine import Engine
from decodespec.reference.request import Timings
from decodespec.reference.request_options import RequestOptions
from tests.engine.toy import ByteTokenizer, greedy, random_weights, run_to_end, small_config


@pytest.fixture(scope="module")
def model():
    return random_weights(small_config(), seed=5)


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
