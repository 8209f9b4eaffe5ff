"""An engine no request can break: bad arguments, faults inside a step, abort,
cache pressure (SEMANTICS.md, "The engine: what batching may not change").

A fault injected at any stage of a step fails only the request that causes
it (finish reason "error", a message); every other request still ends with
exactly its solo output, and the engine takes new requests afterwards.
"""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest
import torch

from decodespec.reference.engine import Engine
from decodespec.spec.params import SamplingParams
from tests.engine.test_engine_vs_spec import assert_request_matches_spec, run_workload
from tests.engine.toy import ByteTokenizer, random_weights, small_config


@pytest.fixture(scope="module")
def weights():
    return random_weights(small_config(max_context=64), seed=3)


def drain(engine: Engine) -> dict[int, list]:
    events: dict[int, list] = {}
    for _ in range(500):
        if not engine.has_unfinished():
            return events
        for e in engine.step():
            events.setdefault(e.request_id, []).append(e)
    raise AssertionError("the engine stopped making progress")


def all_blocks_free(engine: Engine) -> bool:
    return engine.block_manager.allocator.num_free == engine.block_manager.allocator.num_blocks


# ---------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": -4}, ValueError, "block_size"),
        ({"block_size": 2.0}, TypeError, "block_size"),
        ({"cache_tokens": 0}, ValueError, "cache_tokens"),
        ({"cache_tokens": "4096"}, TypeError, "cache_tokens"),
        ({"naive": "false"}, TypeError, "naive"),
        ({"show_probs": 21}, ValueError, "show_probs"),
        ({"show_probs": True}, TypeError, "show_probs"),
        ({"num_draft": 0, "speculate": "ngram"}, ValueError, "num_draft"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"cache_tokens": 10**15}, ValueError, "cannot be allocated: lower cache_tokens"),
        ({"block_size": 10**10}, ValueError, "cannot be allocated"),
        ({"speculate": 3}, TypeError, "speculate"),
        ({"backend": "cuda"}, ValueError, "backend"),
    ],
)
def test_bad_engine_arguments_name_the_argument(weights, kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine(weights, ByteTokenizer(), **kwargs)


@pytest.mark.parametrize(
    ("prompt", "error", "match"),
    [
        ([1.5, 2], TypeError, "prompt_ids"),
        (["12", 2], TypeError, "prompt_ids"),
        ([True, 2], TypeError, "prompt_ids"),
        (torch.tensor([1.0, 2.0]), TypeError, "prompt_ids"),
        ([], ValueError, "prompt"),
        ([1, 300], ValueError, "prompt_ids"),
        ([-1], ValueError, "prompt_ids"),
    ],
)
def test_bad_prompt_ids_name_the_prompt(weights, prompt, error, match):
    engine = Engine(weights, ByteTokenizer())
    with pytest.raises(error, match=match):
        engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished()


def test_prompt_ids_may_be_an_integer_tensor(weights):
    engine = Engine(weights, ByteTokenizer())
    request_id = engine.add_request(torch.tensor([1, 2, 3]), SamplingParams(max_tokens=2))
    assert engine.requests[request_id].prompt_ids == [1, 2, 3]


def test_params_must_be_sampling_params(weights):
    engine = Engine(weights, ByteTokenizer())
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request([1, 2], {"temperature": 0.5})


def test_a_request_that_can_never_fit_the_cache_is_refused_when_added(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=16)
    with pytest.raises(ValueError, match="max_tokens or raise cache_tokens"):
        engine.add_request([1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="the context"):  # max_tokens=None: up to the context
        engine.add_request([1] * 10, SamplingParams(max_tokens=None))
    # Exactly the largest that fits: 10 prompt + 7 new − 1 (the last is never run) = 16.
    request_id = engine.add_request([1] * 10, SamplingParams(max_tokens=7, ignore_eos=True))
    drain(engine)
    assert engine.output(request_id).finish_reason == "length"
    assert all_blocks_free(engine)


# ---------------------------------------------------------------- faults inside a step


VICTIM_SEED = 4242


def fault_workload():
    """Three requests; the second is the victim (its seed, long prompt and token 200
    mark it for the faults below)."""
    base = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={200: -100.0})
    return [
        ([5, 6, 7], dataclasses.replace(base, temperature=0.0), 0),
        (
            list(range(30, 60)),
            dataclasses.replace(
                base,
                temperature=0.9,
                seed=VICTIM_SEED,
                top_logprobs=2,
                logprobs_mode="processed",
                logit_bias={200: 100.0},
            ),
            0,
        ),
        ([8, 9], dataclasses.replace(base, temperature=0.7, seed=7, top_logprobs=1), 1),
    ]


class Boom(RuntimeError):
    pass


def faulty(function, when):
    def wrapper(*args, **kwargs):
        if when(*args, **kwargs):
            raise Boom("injected fault")
        return function(*args, **kwargs)

    return wrapper


def victim_seed(*args, seed=None, **kwargs):
    return seed is not None and bool((seed == VICTIM_SEED).any())


def victim_processed(logits, *, temperature, **kwargs):
    return bool((temperature == 0.9).any())


def assert_only_the_victim_failed(engine, ids, events, weights) -> None:
    """Request 1 failed with the injected fault; 0 and 2 are their spec output."""
    victim = engine.output(ids[1])
    assert victim.finish_reason == "error" and "injected fault" in victim.error
    assert events[ids[1]][-1].finish_reason == "error"
    for index in (0, 2):
        assert_request_matches_spec(engine, ids[index], events[ids[index]], weights)
    assert all_blocks_free(engine)


FAULTS = {
    # stage: (backend field, when it fires)
    "attention": (
        "paged_attention",
        lambda q, k, v, block_table, seq_lens, *a, **k_: bool((seq_lens >= 30).any()),
    ),
    "append": ("append_kv", lambda k, v, kc, vc, slot_mapping, **kw: slot_mapping.numel() >= 30),
    "sample": ("sample", victim_seed),
    "process_logits": ("process_logits", victim_processed),
    "compute_logprobs": (
        "compute_logprobs",
        lambda logits, token_ids, n=0: bool((token_ids == 200).any()),
    ),
}


@pytest.mark.parametrize("stage", sorted(FAULTS))
def test_a_fault_at_any_stage_fails_only_its_request(weights, stage):
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=256)
    field, when = FAULTS[stage]
    engine.runner.backend = engine.sampler.backend = dataclasses.replace(
        engine.backend, **{field: faulty(getattr(engine.backend, field), when)}
    )
    ids, events = run_workload(engine, fault_workload())
    assert_only_the_victim_failed(engine, ids, events, weights)
    # The engine is still usable, and still the spec.
    engine.runner.backend = engine.sampler.backend = engine.backend
    again = engine.add_request([5, 6, 7], fault_workload()[0][1])
    assert_request_matches_spec(engine, again, drain(engine)[again], weights)


def test_a_fault_while_streaming_text_fails_only_its_request(weights):
    """The victim's token 200 has no bytes the tokenizer can give (postprocessing)."""

    class Tokenizer(ByteTokenizer):
        def token_bytes(self, token_id: int) -> bytes:
            if token_id == 200:
                raise Boom("injected fault")
            return super().token_bytes(token_id)

    engine = Engine(weights, Tokenizer(), block_size=4, cache_tokens=256)
    ids, events = run_workload(engine, fault_workload())
    assert_only_the_victim_failed(engine, ids, events, weights)


def test_a_fault_in_the_drafter_fails_only_its_request(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=256, speculate="ngram")
    drafter = engine.drafter
    propose = drafter.propose

    def faulty_propose(requests, counts):
        if any(r.params.seed == VICTIM_SEED for r in requests):
            raise Boom("injected fault")
        return propose(requests, counts)

    drafter.propose = faulty_propose
    workload = [
        (p, dataclasses.replace(params, temperature=0.0) if i != 1 else params, a)
        for i, (p, params, a) in enumerate(fault_workload())
    ]
    ids, events = run_workload(engine, workload)
    assert_only_the_victim_failed(engine, ids, events, weights)


def test_a_fault_in_verification_fails_only_its_request(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=256, speculate="ngram")
    backend = engine.backend
    engine.runner.backend = engine.sampler.backend = dataclasses.replace(
        backend, verify_drafts=faulty(backend.verify_drafts, victim_seed)
    )
    # Repetitive prompts so that prompt lookup drafts for every request.
    workload = [
        ([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=6), 0),
        ([4, 5, 4, 5, 4, 5], SamplingParams(temperature=0.9, seed=VICTIM_SEED, max_tokens=6), 0),
        ([6, 7, 6, 7, 6, 7], SamplingParams(temperature=0.0, max_tokens=6), 0),
    ]
    ids, events = run_workload(engine, workload)
    assert_only_the_victim_failed(engine, ids, events, weights)


def test_a_transient_fault_in_a_batched_pass_fails_no_request(weights):
    """The failed pass is undone and each request rerun alone: all succeed, exactly."""
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=256)
    calls = {"n": 0}

    def once(*args, **kwargs):
        calls["n"] += 1
        return calls["n"] == 3  # the third pass: requests mid-way through decoding

    backend = engine.backend
    engine.runner.backend = engine.sampler.backend = dataclasses.replace(
        backend, paged_attention=faulty(backend.paged_attention, once)
    )
    ids, events = run_workload(engine, fault_workload())
    for index in range(3):
        assert engine.output(ids[index]).finish_reason == "length"
        assert_request_matches_spec(engine, ids[index], events[ids[index]], weights)
    assert all_blocks_free(engine)


def test_parameters_that_make_logits_invalid_are_named(weights):
    """Valid logits made invalid by the request's own processing (min_tokens masks the
    only finite logit, EOS): the error says so, not "the model produced NaN"."""
    engine = Engine(weights, ByteTokenizer())
    other = engine.add_request([3, 4], SamplingParams(temperature=0.0, max_tokens=3))
    forward = engine.runner.forward

    def only_eos(batch, drafts):
        logits, cached = forward(batch, drafts)
        if any(r.params.min_tokens for r in batch):
            logits[:] = -float("inf")
            logits[:, 256] = 0.0
        return logits, cached

    engine.runner.forward = only_eos
    request_id = engine.add_request([1, 2], SamplingParams(temperature=0.0, min_tokens=1))
    drain(engine)
    out = engine.output(request_id)
    assert out.finish_reason == "error" and "logit processors" in out.error
    assert engine.output(other).finish_reason in ("stop", "length")


def test_nan_logits_fail_the_request_and_name_the_model(weights):
    engine = Engine(weights, ByteTokenizer())
    forward = engine.runner.forward

    def nan(batch, drafts):
        logits, cached = forward(batch, drafts)
        return logits * float("nan"), cached

    engine.runner.forward = nan
    request_id = engine.add_request([1, 2], SamplingParams(temperature=0.0))
    drain(engine)
    assert "the model produced NaN" in engine.output(request_id).error


# ---------------------------------------------------------------- abort


def test_closing_a_stream_aborts_its_request_and_frees_its_blocks(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=2, cache_tokens=64)
    stream = engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    next(stream)
    assert not all_blocks_free(engine)
    stream.close()
    assert all_blocks_free(engine) and not engine.has_unfinished()
    request = engine.requests[0]
    assert request.finish_reason == "abort" and len(request.output_ids) == 1


def test_a_dropped_stream_aborts_its_request(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=2, cache_tokens=64)
    stream = engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    next(stream)
    del stream
    gc.collect()
    assert all_blocks_free(engine) and not engine.has_unfinished()


def test_streams_read_in_turns_each_get_all_their_events(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=2, cache_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    streams = [engine.generate([1, 2, 3], params), engine.generate([7, 8], params)]
    received: list[list] = [[], []]
    live = [0, 1]
    while live:
        for i in list(live):
            event = next(streams[i], None)
            if event is None:
                live.remove(i)
            else:
                received[i].append(event)
    for i, events in enumerate(received):
        out = engine.output(i)
        assert [e.token_id for e in events] == out.token_ids and len(events) == 6
        assert "".join(e.text for e in events) == out.text
        assert_request_matches_spec(engine, i, events, weights)
    assert all_blocks_free(engine)


def test_abort_of_waiting_running_and_finished_requests(weights):
    engine = Engine(weights, ByteTokenizer(), block_size=2, cache_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    running = engine.add_request([1, 2, 3], params)
    engine.step()
    waiting = engine.add_request([4, 5], params)
    assert engine.abort(waiting) and engine.abort(running)
    assert not engine.has_unfinished() and all_blocks_free(engine)
    assert engine.step() == []
    assert not engine.abort(running)  # already finished
    with pytest.raises(ValueError, match="no request with id 99"):
        engine.abort(99)
    with pytest.raises(ValueError, match="no request with id"):
        engine.output(99)


# ---------------------------------------------------------------- cache pressure


def test_eight_requests_in_four_blocks_all_finish_with_their_solo_output(weights):
    """Running requests are preempted and recomputed, never failed for lack of cache."""
    engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=16)
    workload = [
        (
            [10 + i, 11 + i, 12 + i],
            SamplingParams(
                temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=12, ignore_eos=True
            ),
            0,
        )
        for i in range(8)
    ]
    ids, events = run_workload(engine, workload)
    assert all(engine.output(i).finish_reason == "length" for i in ids.values())
    assert sum(engine.output(i).preemptions for i in ids.values()) > 0
    for request_id in ids.values():
        assert_request_matches_spec(engine, request_id, events[request_id], weights)
    assert all_blocks_free(engine)


# ---------------------------------------------------------------- odd values everywhere

ODD_VALUES = [
    None, True, False, 0, 1, -1, 2**63, 2**64, -(2**63), 10**30, 0.0, -0.0, 1e-46, 1e-40,
    1e-38, 1e-30, 0.5, 1.0, 1.5, 2.0, 100.0, 1e38, 1e39, math.inf, -math.inf, math.nan,
    "1", "abc", "", b"x", 1 + 0j, [], [1], [""], ["a"], {}, {1: 1.0}, {-1: 1.0},
    {300: 1.0}, {1: math.nan}, {"a": 1}, (1,), np.float32(0.5), np.int64(3),
    torch.tensor(0.5), torch.tensor([1, 2]), object(), "raw", "processed", [2**70], [-5],
]  # fmt: skip


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(SamplingParams)])
def test_every_odd_value_is_refused_by_name_or_runs_beside_a_healthy_request(weights, field):
    """Each odd value of each parameter: a TypeError or ValueError that names the
    parameter, or a request that runs to a finish without disturbing its neighbour."""
    for value in ODD_VALUES:
        where = f"{field}={value!r}"
        try:
            params = SamplingParams(**{field: value})
        except (TypeError, ValueError) as error:
            assert field in str(error), f"{where}: {error}"
            continue
        engine = Engine(weights, ByteTokenizer(), block_size=4, cache_tokens=256)
        try:
            request_id = engine.add_request([1, 2, 3], params)
        except (TypeError, ValueError):
            continue  # refused against the model (ids outside the vocabulary, ...)
        healthy = engine.add_request(
            [4, 5], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        )
        drain(engine)
        assert engine.output(healthy).finish_reason == "length", where
        assert engine.output(request_id).finish_reason in ("stop", "length"), where
        assert all_blocks_free(engine), where
