"""Every engine configuration emits, for every request, the spec loop's output on
that request alone (SEMANTICS.md, "The engine: what batching may not change").

Hypothesis draws small random models, requests with random parameters that
arrive at random steps in random order, and an engine configuration: cache
sizes small enough to force preemption, block sizes, naive decode, each
drafter, the triton backend (interpreter, small shapes). Each request's
tokens, text, finish reason and logprobs must be those of
`decodespec.spec.generate.generate` run on it alone.

The default engine (the torch backend) is batch-invariant by construction
(LOOP-INVARIANT-1): against the loop with its own forward pass and stage
functions it is compared bit for bit, every token and logprob, with no
tolerance (`test_the_default_engine_is_the_spec_loop_bit_for_bit` below).

Against the spec's own forward pass, a CPU matmul is not batch-invariant: a
batched pass may change a logit in its last bits. Where that can change a
token, the test decides it explicitly: the spec's loop runs teacher-forced
(`ForcedChoice`), and at a step where the engine's token differs from the
spec's, the engine's token is accepted
only if the spec's own `sample` picks it from logits moved by at most
`NEAR_TIE` toward it (the most favourable move: that token up, every other
down). Nothing else is loosened; the number of such steps is small and is
reported with `hypothesis.event`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from decodespec.reference.engine import Engine
from decodespec.spec import sampling
from decodespec.spec.generate import StepOutput, generate
from decodespec.spec.params import SamplingParams
from tests.engine.toy import ByteTokenizer, random_weights, small_config

# Largest change batching makes to a raw logit, with margin: the batch-variance of
# float32 matmuls on these models is of order 1e-6.
NEAR_TIE = 1e-4


class ForcedChoice:
    """`sample` for the spec's loop that follows the engine's tokens where, and only
    where, the spec's own choice is a near tie with the engine's."""

    def __init__(self, engine_tokens: list[int]) -> None:
        self.engine_tokens = engine_tokens
        self.near_ties: list[int] = []

    def __call__(self, logits: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
        spec_token = sampling.sample(logits, **tensors)
        step = int(tensors["step"][0])
        if step >= len(self.engine_tokens) or int(spec_token[0]) == self.engine_tokens[step]:
            return spec_token
        theirs = self.engine_tokens[step]
        toward = torch.full_like(logits, -NEAR_TIE)
        toward[0, theirs] = NEAR_TIE
        if int(sampling.sample(logits + toward, **tensors)[0]) == theirs:
            self.near_ties.append(step)
            return torch.tensor([theirs], device=logits.device)
        return spec_token


class RankSlack:
    """`compute_logprobs` for the spec's loop that also records, at each step, how many
    other tokens' logprobs lie within `2 · NEAR_TIE` of the chosen token's: how far
    its rank may move when the engine's logits move by `NEAR_TIE`."""

    def __init__(self) -> None:
        self.slack: list[int] = []

    def __call__(self, logits: torch.Tensor, token_ids: torch.Tensor, top: int):
        values = torch.log_softmax(logits[0].double(), dim=-1)
        chosen = values[int(token_ids[0])]
        self.slack.append(int(((values - chosen).abs() < 2 * NEAR_TIE).sum()) - 1)
        return sampling.compute_logprobs(logits, token_ids, top)


def spec_outputs(
    weights, tokenizer, prompt, params, engine_tokens
) -> tuple[list[StepOutput], int, list[int]]:
    """The spec loop on the request alone, how many near ties it followed, and each
    logprob's `RankSlack`."""
    choice, slack = ForcedChoice(engine_tokens), RankSlack()
    steps = list(
        generate(
            weights,
            prompt,
            params,
            eos_token_ids=tokenizer.eos_token_ids,
            token_bytes=tokenizer.token_bytes,
            sample=choice,
            compute_logprobs=slack,
        )
    )
    return steps, len(choice.near_ties), slack.slack


def assert_logprobs_match(ours, spec, where: str, slack: int = 0) -> None:
    """Values to float32 batch noise; ids exactly unless values tie within it, and
    ranks within `slack` (the tokens whose logprobs tie the chosen one's within it)."""
    if spec is None:
        assert ours is None, where
        return
    assert ours is not None, where
    assert ours.token_id == spec.token_id, where
    assert ours.logprob == pytest.approx(spec.logprob, abs=NEAR_TIE), where
    spec_values = [lp for _, lp in spec.top]
    near = [abs(v - spec.logprob) < 2 * NEAR_TIE for v in spec_values]
    if not any(near):
        assert abs(ours.rank - spec.rank) <= slack, where
    assert len(ours.top) == len(spec.top), where
    for i, ((o_id, o_lp), (s_id, s_lp)) in enumerate(zip(ours.top, spec.top, strict=True)):
        assert o_lp == pytest.approx(s_lp, abs=NEAR_TIE), where
        neighbours = spec_values[max(0, i - 1) : i + 2]
        if sum(abs(v - s_lp) < 2 * NEAR_TIE for v in neighbours) == 1:
            assert o_id == s_id, where


def assert_request_matches_spec(engine: Engine, request_id: int, events: list, weights) -> int:
    """The engine's events for one request equal the spec loop's; returns near ties."""
    request = engine.requests[request_id]
    out = engine.output(request_id)
    tokens = [e.token_id for e in events]
    expected, near_ties, slack = spec_outputs(
        weights, engine.tokenizer, request.prompt_ids, request.params, tokens
    )
    where = f"request {request_id}: prompt {request.prompt_ids}, {request.params}"
    assert tokens == [s.token_id for s in expected], where
    assert [e.text for e in events] == [s.text for s in expected], where
    assert [e.finish_reason for e in events] == [s.finish_reason for s in expected], where
    assert out.token_ids == tokens and out.finish_reason == expected[-1].finish_reason, where
    slacks = iter(slack)
    for i, (e, s) in enumerate(zip(events, expected, strict=True)):
        step_slack = 0 if s.logprobs is None else next(slacks)
        assert_logprobs_match(e.logprobs, s.logprobs, f"{where}, token {i}", step_slack)
    return near_ties


# ---------------------------------------------------------------- strategies


@st.composite
def request_params(draw: st.DrawFn, sampled: bool, vocab: int) -> SamplingParams:
    temperature = draw(st.sampled_from((0.5, 0.8, 1.0, 1.5))) if sampled else 0.0
    stop = draw(st.sampled_from(((), ("a",), ("ab", "\n"))))
    return SamplingParams(
        temperature=temperature,
        top_k=draw(st.sampled_from((0, 0, 3, 20))),
        top_p=draw(st.sampled_from((1.0, 1.0, 0.9, 0.5))),
        min_p=draw(st.sampled_from((0.0, 0.0, 0.05))),
        repetition_penalty=draw(st.sampled_from((1.0, 1.0, 1.3, 0.8))),
        frequency_penalty=draw(st.sampled_from((0.0, 0.0, 0.5))),
        presence_penalty=draw(st.sampled_from((0.0, 0.0, -0.5))),
        logit_bias=draw(st.sampled_from(({}, {97: 3.0}, {10: -5.0, 98: 2.0}))),
        max_tokens=(max_tokens := draw(st.integers(1, 12))),
        min_tokens=min(max_tokens, draw(st.sampled_from((0, 0, 2)))),
        seed=draw(st.integers(0, 2**64 - 1)) if sampled else None,
        stop=stop,
        stop_token_ids=draw(st.sampled_from(((), (99,)))),
        ignore_eos=draw(st.booleans()),
        top_logprobs=draw(st.sampled_from((None, None, 0, 3))),
        logprobs_mode=draw(st.sampled_from(("raw", "processed"))),
    )


@st.composite
def workloads(draw: st.DrawFn, sampled: bool = True, max_requests: int = 5):
    """Requests (prompt, params, arrival step), in the order they are added."""
    vocab = 260
    count = draw(st.integers(1, max_requests))
    requests = []
    for _ in range(count):
        prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=12))
        params = draw(request_params(sampled and draw(st.booleans()), vocab))
        arrival = draw(st.integers(0, 6))
        requests.append((prompt, params, arrival))
    return requests


def run_workload(engine: Engine, workload, abort_at: dict[int, int] | None = None, after_step=None):
    """Add each request at its arrival step (ties in list order), step until done;
    `abort_at` maps a workload index to the step at which it is aborted;
    `after_step(engine)` runs after every step (invariant checks)."""
    abort_at = abort_at or {}
    ids: dict[int, int] = {}
    events: dict[int, list] = {}
    step = 0
    while len(ids) < len(workload) or engine.has_unfinished():
        for index, (prompt, params, arrival) in enumerate(workload):
            if arrival == step or (arrival < step and index not in ids):
                ids[index] = engine.add_request(prompt, params)
                events[ids[index]] = []
        for index, when in abort_at.items():
            if when == step and index in ids:
                engine.abort(ids[index])
        for e in engine.step():
            events[e.request_id].append(e)
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 500, "the engine stopped making progress"
    return ids, events


def check_all(engine: Engine, weights, ids, events, skip=()) -> None:
    near_ties = 0
    for index, request_id in ids.items():
        if index in skip:
            continue
        near_ties += assert_request_matches_spec(engine, request_id, events[request_id], weights)
    if currently_in_test_context():
        event(f"near ties followed: {near_ties}")
    assert engine.cache is None or (
        engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks
    ), "blocks leaked"


# Chunked prefill's budgets: prompts (up to 12 tokens) in chunks of 1 or 3 tokens
# beside the decoding requests, or whole (the default budget, or none).
TOKEN_BUDGETS = st.sampled_from((1, 3, 64, None))


def small_model(seed: int):
    return random_weights(small_config(max_context=64), seed=seed)


# ---------------------------------------------------------------- the configurations


@pytest.mark.clause("LOOP-SAMPLE-1", "LOOP-STOP-1")
@given(workload=workloads(max_requests=1), seed=st.integers(0, 50))
def test_a_single_request_is_the_spec_loop(workload, seed):
    weights = small_model(seed)
    engine = Engine(weights, ByteTokenizer())
    check_all(engine, weights, *run_workload(engine, workload))


@pytest.mark.clause("LOOP-SAMPLE-1", "LOOP-DECODE-1")
@given(
    workload=workloads(),
    seed=st.integers(0, 50),
    block_size=st.sampled_from((1, 2, 4, 16)),
    naive=st.booleans(),
    token_budget=TOKEN_BUDGETS,
    long_prompt_chunk=st.sampled_from((None, 1, 2)),
    long_prompt_interval=st.sampled_from((1, 2, 3)),
)
def test_requests_joining_and_leaving_are_each_the_spec_loop(
    workload, seed, block_size, naive, token_budget, long_prompt_chunk, long_prompt_interval
):
    """Prompts whole or in chunks of a small token budget (chunked prefill), a long
    prompt's chunks smaller still while others decode, and not in every pass."""
    weights = small_model(seed)
    engine = Engine(weights, ByteTokenizer(), block_size=block_size, naive=naive,
                    token_budget=token_budget, long_prompt_chunk=long_prompt_chunk,
                    long_prompt_interval=long_prompt_interval)  # fmt: skip
    check_all(engine, weights, *run_workload(engine, workload))


@pytest.mark.clause("LOOP-PREFILL-1")
@given(workload=workloads(), seed=st.integers(0, 50), data=st.data())
def test_preempted_and_recomputed_requests_are_each_the_spec_loop(workload, seed, data):
    """A cache barely larger than the largest request: running requests are
    preempted and recomputed, none fails, each ends with its solo output."""
    weights = small_model(seed)
    block_size = data.draw(st.sampled_from((1, 2, 4)))
    largest = max(len(p) + (params.max_tokens or 0) - 1 for p, params, _ in workload)
    blocks = -(-largest // block_size) + data.draw(st.integers(0, 3))
    engine = Engine(
        weights,
        ByteTokenizer(),
        block_size=block_size,
        cache_tokens=blocks * block_size,
        token_budget=data.draw(TOKEN_BUDGETS),
    )
    ids, events = run_workload(engine, workload)
    preempted = sum(engine.requests[i].preemptions for i in ids.values())
    event(f"preemptions > 0: {preempted > 0}")
    assert all(engine.output(i).finish_reason in ("stop", "length") for i in ids.values())
    check_all(engine, weights, ids, events)


@pytest.mark.clause("LOOP-INVARIANT-1")
@settings(max_examples=25)
@given(
    workload=workloads(),
    seed=st.integers(0, 50),
    block_size=st.sampled_from((1, 2, 4, 16)),
    token_budget=TOKEN_BUDGETS,
    spare_blocks=st.sampled_from((0, 2, None)),
)
def test_the_default_engine_is_the_spec_loop_bit_for_bit(
    workload, seed, block_size, token_budget, spare_blocks
):
    """LOOP-INVARIANT-1 with no tolerance: the default engine (the torch backend's
    native step on every pass, its one-thread sampling stages), running requests that
    join and leave, in chunks of a small token budget, preempted and recomputed in a
    cache barely larger than the largest request, gives each request every token,
    text, finish reason and logprob of the spec loop on it alone with the engine's
    forward pass (`hidden_states`) and stage functions: bitwise, no near tie."""
    weights = small_model(seed)
    cache_tokens = 16_384
    if spare_blocks is not None:
        largest = max(len(p) + (params.max_tokens or 0) - 1 for p, params, _ in workload)
        cache_tokens = (-(-largest // block_size) + spare_blocks) * block_size
    engine = Engine(weights, ByteTokenizer(), backend="torch", block_size=block_size,
                    cache_tokens=cache_tokens, token_budget=token_budget)  # fmt: skip
    assert engine.runner.native is not None and engine.batch_invariant
    ids, events = run_workload(engine, workload)
    backend, tokenizer = engine.backend, engine.tokenizer
    for request_id in ids.values():
        request = engine.requests[request_id]
        loop = generate(
            engine.weights, request.prompt_ids, request.params,
            eos_token_ids=tokenizer.eos_token_ids, token_bytes=tokenizer.token_bytes,
            block_size=block_size, hidden_states=engine.runner.native, sample=backend.sample,
            process_logits=backend.process_logits, compute_logprobs=backend.compute_logprobs,
        )  # fmt: skip
        expected = [(s.token_id, s.text, s.finish_reason, s.logprobs) for s in loop]
        got = [(e.token_id, e.text, e.finish_reason, e.logprobs) for e in events[request_id]]
        assert got == expected, f"prompt {request.prompt_ids}, {request.params}"
    event(f"preemptions > 0: {sum(engine.requests[i].preemptions for i in ids.values()) > 0}")


@pytest.mark.clause("LOOP-STOP-1")
@given(workload=workloads(), seed=st.integers(0, 50), data=st.data())
def test_aborted_requests_leave_the_others_their_spec_output(workload, seed, data):
    weights = small_model(seed)
    engine = Engine(weights, ByteTokenizer(), block_size=2, cache_tokens=48)
    victim = data.draw(st.integers(0, len(workload) - 1))
    when = data.draw(st.integers(0, 8))
    ids, events = run_workload(engine, workload, abort_at={victim: when})
    check_all(engine, weights, ids, events, skip={victim})
    # What the aborted request did emit is a prefix of its own spec output.
    request_id = ids[victim]
    tokens = [e.token_id for e in events[request_id]]
    request = engine.requests[request_id]
    expected, _, _ = spec_outputs(
        weights, ByteTokenizer(), request.prompt_ids, request.params, tokens
    )
    assert tokens == [s.token_id for s in expected][: len(tokens)]


def draft_model_of(weights):
    config = dataclasses.replace(weights.config, num_layers=1, hidden_size=16, head_dim=4)
    return random_weights(config, seed=99)


@pytest.mark.clause("LOOP-SAMPLE-1")
@given(
    workload=workloads(sampled=False),
    seed=st.integers(0, 50),
    speculate=st.sampled_from(("ngram", "layers:1", "model")),
    num_draft=st.integers(1, 4),
    cache_tokens=st.sampled_from((24, 64, 1024)),
    token_budget=TOKEN_BUDGETS,
)
def test_speculative_decoding_is_the_spec_loop(
    workload, seed, speculate, num_draft, cache_tokens, token_budget
):
    """Greedy: token for token. (Sampled requests keep the target's distribution,
    not its exact draws: tests/engine/test_speculative_engine.py checks that.)"""
    weights = small_model(seed)
    largest = max(len(p) + (params.max_tokens or 0) for p, params, _ in workload)
    engine = Engine(
        weights,
        ByteTokenizer(),
        block_size=2,
        cache_tokens=max(cache_tokens, largest),
        speculate=speculate,
        num_draft=num_draft,
        draft_model=draft_model_of(weights) if speculate == "model" else None,
        token_budget=token_budget,
    )
    check_all(engine, weights, *run_workload(engine, workload))


@pytest.mark.clause("LOOP-SAMPLE-1")
@settings(max_examples=4)
@given(workload=workloads(max_requests=3), seed=st.integers(0, 50))
def test_the_triton_backend_is_the_spec_loop(workload, seed):
    pytest.importorskip("triton")
    weights = random_weights(
        small_config(max_context=32, vocab_size=260, hidden_size=16, num_layers=1), seed=seed
    )
    engine = Engine(weights, ByteTokenizer(), backend="triton", block_size=4, cache_tokens=64)
    check_all(engine, weights, *run_workload(engine, workload))


# ---------------------------------------------------------------- the bundled model


@pytest.fixture(scope="module")
def smollm():
    from decodespec.reference.loader import load_model
    from decodespec.reference.model_files import bundled_model_path

    return load_model(bundled_model_path())


@pytest.mark.clause("LOOP-SAMPLE-1")
def test_bundled_model_batched_and_preempted_is_the_spec_loop(smollm):
    """Four questions at once (two sampled) on SmolLM2 in a cache too small for
    all of them: every answer is its solo spec-loop answer."""
    weights, tokenizer = smollm
    questions = ["The capital of France is", "1, 2, 3,", "Water boils at", "Hello! My name"]
    workload = [
        (
            tokenizer.encode(q),
            SamplingParams(
                temperature=0.0 if i % 2 == 0 else 0.8,
                seed=None if i % 2 == 0 else 1000 + i,
                max_tokens=10,
                top_logprobs=2,
                ignore_eos=True,
            ),
            i,
        )
        for i, q in enumerate(questions)
    ]
    engine = Engine(weights, tokenizer, block_size=4, cache_tokens=48)
    ids, events = run_workload(engine, workload)
    preemptions = [engine.requests[i].preemptions for i in ids.values()]
    assert sum(preemptions) > 0, f"precondition: the cache is small enough to preempt {preemptions}"
    check_all(engine, weights, ids, events)
