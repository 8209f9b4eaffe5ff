"""Prompt logprobs (`Engine.add_request(prompt_logprobs=k)`): per prompt position, the
raw score of the prompt token, its rank and the top-k, as the spec defines them.

The expected values come from the spec's own functions, computed here
independently of the engine: `forward_naive(weights, prompt)` logits, then
`log_softmax` in float64 at each position (LOGPROB-RAW-1), the rank as
`1 + #{j : lp_j > lp_token}` (LOGPROB-RANK-1) and the top-k in descending
order, ties to the smaller id (LOGPROB-TOP-1). Position 0 has no score (None).

Each engine configuration must give them: batched with other requests (whose
outputs the scoring request must not change), projected a few rows at a time,
behind a cached prefix (which must not hide positions), preempted and
recomputed (no position twice), speculating, with a grammar, naive.
"""

from __future__ import annotations

import math

import pytest
import torch

from decodespec.reference import runner as runner_module
from decodespec.reference.engine import Engine
from decodespec.reference.grammar import StructuredOutput
from decodespec.reference.request_options import RequestOptions
from decodespec.spec.forward import forward_naive
from decodespec.spec.generate import TokenLogprobs
from decodespec.spec.params import SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config

WEIGHTS = random_weights(small_config(), seed=3)
TOL = 1e-4  # float32 logprobs, abs

PROMPTS = [
    list(b"the quick brown fox jumps over the lazy dog"),
    list(b"abcabcabcabcabcabc"),
    list(b"hello, world"),
    list(b"Z"),
]


def expected(prompt: list[int], k: int) -> list[TokenLogprobs | None]:
    """The spec's scores of `prompt`: forward_naive logits, log_softmax at each position."""
    logits = forward_naive(WEIGHTS, torch.tensor(prompt))
    lsm = torch.log_softmax(logits.double(), dim=-1)
    records: list[TokenLogprobs | None] = [None]
    for t in range(1, len(prompt)):
        row = lsm[t - 1]
        value = float(row[prompt[t]])
        order = sorted(range(row.shape[0]), key=lambda i: (-float(row[i]), i))[:k]
        top = [(i, float(row[i])) for i in order]
        records.append(TokenLogprobs(prompt[t], value, 1 + int((row > value).sum()), top))
    return records


def check(actual: list[TokenLogprobs | None] | None, prompt: list[int], k: int) -> None:
    want = expected(prompt, k)
    assert actual is not None
    assert len(actual) == len(want) == len(prompt)
    assert actual[0] is None
    for t, (got, ref) in enumerate(zip(actual[1:], want[1:], strict=True), start=1):
        assert got.token_id == ref.token_id == prompt[t], f"position {t}"
        assert math.isclose(got.logprob, ref.logprob, rel_tol=1e-5, abs_tol=TOL), f"position {t}"
        assert got.rank == ref.rank, f"position {t}: rank"
        assert [i for i, _ in got.top] == [i for i, _ in ref.top], f"position {t}: top ids"
        for (_, a), (_, b) in zip(got.top, ref.top, strict=True):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=TOL), f"position {t}: top logprob"


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams, int | None]]) -> list:
    ids = [
        engine.add_request(p, params, RequestOptions(prompt_logprobs=k))
        for p, params, k in requests
    ]
    while engine.has_unfinished():
        engine.step()
    return [engine.release(i) for i in ids]


def greedy(n: int = 6, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def sampled(seed: int, n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True)


def workload(k: int | None) -> list[tuple[list[int], SamplingParams, int | None]]:
    """A scored request among unconstrained neighbours (one sampled, one with logprobs)."""
    return [
        (PROMPTS[1], sampled(7), None),
        (PROMPTS[0], sampled(11, n=8), k),
        (PROMPTS[2], greedy(top_logprobs=3), None),
        (PROMPTS[1][:5], sampled(5), None),
    ]


def same_outputs(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        if x.logprobs is not None:
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                assert p.token_id == q.token_id and p.rank == q.rank
                assert math.isclose(p.logprob, q.logprob, abs_tol=TOL)


@pytest.mark.parametrize("backend", ["spec", "torch"])
def test_batched_scores_equal_the_spec_and_leave_neighbours_unchanged(backend):
    scored = run(Engine(WEIGHTS, ByteTokenizer(), backend=backend, block_size=4), workload(5))
    check(scored[1].prompt_logprobs, PROMPTS[0], 5)
    assert [o.prompt_logprobs for i, o in enumerate(scored) if i != 1] == [None] * 3
    plain = run(Engine(WEIGHTS, ByteTokenizer(), backend=backend, block_size=4), workload(None))
    assert plain[1].prompt_logprobs is None
    same_outputs(scored, plain)  # the scored request's own tokens too


def test_k_zero_gives_only_the_prompt_tokens_own_score():
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4)
    (out,) = run(engine, [(PROMPTS[2], greedy(2), 0)])
    check(out.prompt_logprobs, PROMPTS[2], 0)
    assert all(r.top == [] for r in out.prompt_logprobs[1:])
    (one,) = run(engine, [(PROMPTS[3], greedy(2), 20)])
    assert one.prompt_logprobs == [None]  # a one-token prompt: nothing to score


def test_the_first_step_output_carries_the_scores():
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4)
    events = list(engine.generate(PROMPTS[2], greedy(3)))
    assert all(e.prompt_logprobs is None for e in events)
    request = engine.add_request(PROMPTS[2], greedy(3), RequestOptions(prompt_logprobs=2))
    first = [e for e in engine.step() if e.request_id == request]
    check(first[0].prompt_logprobs, PROMPTS[2], 2)
    while engine.has_unfinished():
        assert all(e.prompt_logprobs is None for e in engine.step())


def test_scores_are_projected_a_few_rows_at_a_time(monkeypatch):
    rows = []
    project = runner_module.project_logits

    def counted(hidden, output):
        rows.append(hidden.shape[0])
        return project(hidden, output)

    monkeypatch.setattr(runner_module, "project_logits", counted)
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4)
    engine.runner.score_rows = 3
    (out,) = run(engine, [(PROMPTS[0], greedy(2), 4)])
    check(out.prompt_logprobs, PROMPTS[0], 4)
    assert max(rows) == 3 and sum(rows) >= len(PROMPTS[0]) - 1


def test_a_cached_prefix_does_not_hide_positions():
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4, prefix_caching=True)
    prefix = PROMPTS[0][:24]
    run(engine, [(prefix, greedy(2), None)])
    prompt = prefix + list(b" again")
    (reuse,) = run(engine, [(prompt, greedy(2), None)])
    assert reuse.cached_tokens >= 20  # the cache holds the prefix: it could hide positions
    (scored,) = run(engine, [(prompt, greedy(2), 3)])
    check(scored.prompt_logprobs, prompt, 3)
    assert scored.cached_tokens == 0
    assert (
        scored.token_ids
        == reuse.token_ids
        == run(Engine(WEIGHTS, ByteTokenizer()), [(prompt, greedy(2), None)])[0].token_ids
    )
    # Its blocks are published for others: a longer prompt maps them.
    (after,) = run(engine, [(prompt + list(b"!!!!"), greedy(2), None)])
    assert after.cached_tokens >= len(prompt) - 4


def test_preempted_and_recomputed_requests_score_each_position_once():
    requests = [(p, greedy(10), k) for p, k in zip(PROMPTS[:3], (2, 5, None), strict=True)]
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=2, cache_tokens=64)
    outputs = run(engine, requests)
    assert sum(o.preemptions for o in outputs) > 0
    check(outputs[0].prompt_logprobs, PROMPTS[0], 2)
    check(outputs[1].prompt_logprobs, PROMPTS[1], 5)
    same_outputs(outputs, run(Engine(WEIGHTS, ByteTokenizer()), requests))


def test_a_speculating_engine_scores_the_prompt():
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4, speculate="ngram", num_draft=3)
    requests = [
        (PROMPTS[1], greedy(8), 4),
        (PROMPTS[1][:9], greedy(8), None),
        (PROMPTS[2], sampled(3, n=3), 1),
    ]
    outputs = run(engine, requests)
    assert sum(o.draft_tokens for o in outputs) > 0
    check(outputs[0].prompt_logprobs, PROMPTS[1], 4)
    check(outputs[2].prompt_logprobs, PROMPTS[2], 1)
    same_outputs(outputs, run(Engine(WEIGHTS, ByteTokenizer()), requests))


def test_a_constrained_request_scores_its_prompt():
    pytest.importorskip("xgrammar")
    grammar = StructuredOutput("regex", source="[ab]{1,3}(x|yz)", field="t")
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4)
    params = SamplingParams(temperature=0, max_tokens=8)
    scored = engine.add_request(
        PROMPTS[2], params, RequestOptions(structured_output=grammar, prompt_logprobs=3)
    )
    plain = engine.add_request(PROMPTS[2], params, RequestOptions(structured_output=grammar))
    while engine.has_unfinished():
        engine.step()
    a, b = engine.release(scored), engine.release(plain)
    check(a.prompt_logprobs, PROMPTS[2], 3)
    assert a.token_ids == b.token_ids and a.finish_reason == "stop"


def test_the_naive_engine_scores_the_prompt():
    requests = [(PROMPTS[2], greedy(3), 3), (PROMPTS[1], sampled(4, n=3), None)]
    outputs = run(Engine(WEIGHTS, ByteTokenizer(), naive=True), requests)
    check(outputs[0].prompt_logprobs, PROMPTS[2], 3)
    same_outputs(outputs, run(Engine(WEIGHTS, ByteTokenizer()), requests))


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_invalid_prompt_logprobs_are_refused(bad):
    engine = Engine(WEIGHTS, ByteTokenizer(), block_size=4)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request(PROMPTS[2], greedy(2), RequestOptions(prompt_logprobs=bad))
    (out,) = run(engine, [(PROMPTS[2], greedy(2), 20)])
    check(out.prompt_logprobs, PROMPTS[2], 20)
