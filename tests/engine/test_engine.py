"""The engine on small random models: cached = naive, batching, stops, errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec import kernels
from decodespec.reference.backend import SPEC_BACKEND, STAGE_OPERATIONS, get_backend
from decodespec.reference.engine import Engine
from decodespec.spec.forward import PagedBatch, forward_cached, forward_naive
from decodespec.spec.params import SamplingParams
from tests.engine.toy import LLAMA3_SCALING, ByteTokenizer, random_weights, small_config

# ---------------------------------------------------------------- cached = naive


@st.composite
def model_configs(draw: st.DrawFn):
    num_kv_heads = draw(st.sampled_from((1, 2, 3)))
    return small_config(
        vocab_size=draw(st.integers(20, 300)),
        hidden_size=draw(st.sampled_from((16, 24, 32))),
        intermediate_size=draw(st.sampled_from((16, 48))),
        num_layers=draw(st.integers(1, 2)),
        num_heads=num_kv_heads * draw(st.sampled_from((1, 2, 3))),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from((4, 8, 16))),
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        rope_scaling=draw(st.sampled_from((None, LLAMA3_SCALING))),
    )


@pytest.mark.clause("FWD-CACHE-1")
@given(config=model_configs(), data=st.data())
def test_cached_forward_equals_naive_forward(config, data):
    """Several sequences, each split into random chunks (prefill, chunked prefill,
    decode steps), packed together per step over a scattered block table."""
    weights = random_weights(config, seed=data.draw(st.integers(0, 1000)))
    block_size = data.draw(st.sampled_from((1, 2, 3, 16)))
    num_seqs = data.draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    lengths = [data.draw(st.integers(1, 24)) for _ in range(num_seqs)]
    sequences = [torch.randint(config.vocab_size, (n,), generator=g) for n in lengths]
    chunks = []  # per sequence: chunk sizes that add up to its length
    for n in lengths:
        sizes, left = [], n
        while left:
            sizes.append(data.draw(st.integers(1, left)))
            left -= sizes[-1]
        chunks.append(sizes)
    max_blocks = max(-(-n // block_size) for n in lengths)
    num_blocks = num_seqs * max_blocks + 2
    blocks = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks].view(
        num_seqs, max_blocks
    )
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    cache = [
        (torch.full(shape, math.nan), torch.full(shape, math.nan)) for _ in range(config.num_layers)
    ]
    expected = [forward_naive(weights, s) for s in sequences]
    done = [0] * num_seqs
    got = [[] for _ in range(num_seqs)]
    step = 0
    while any(done[i] < lengths[i] for i in range(num_seqs)):
        # Each step, every unfinished sequence contributes its next chunk.
        active = [i for i in range(num_seqs) if done[i] < lengths[i]]
        tokens, positions, slots, starts = [], [], [], [0]
        for i in active:
            size = chunks[i][len(got[i])]
            pos = list(range(done[i], done[i] + size))
            tokens += sequences[i][done[i] : done[i] + size].tolist()
            positions += pos
            slots += [int(blocks[i, p // block_size]) * block_size + p % block_size for p in pos]
            starts.append(starts[-1] + size)
        batch = PagedBatch(
            positions=torch.tensor(positions),
            query_start=torch.tensor(starts),
            seq_lens=torch.tensor([done[i] + chunks[i][len(got[i])] for i in active]),
            block_table=blocks[active],
            slot_mapping=torch.tensor(slots),
            logits_indices=torch.arange(len(tokens)),
        )
        logits = forward_cached(weights, torch.tensor(tokens), batch, cache)
        for j, i in enumerate(active):
            got[i].append(logits[starts[j] : starts[j + 1]])
            done[i] += chunks[i][len(got[i]) - 1]
        step += 1
    for i in range(num_seqs):
        cached = torch.cat(got[i])
        note(f"sequence {i}: chunks {chunks[i]}, block size {block_size}")
        scale = expected[i].abs().max()
        assert (cached - expected[i]).abs().max() <= 1e-4 * scale, (
            (cached - expected[i]).abs().max()
        )
        assert torch.equal(cached.argmax(-1), expected[i].argmax(-1))


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def model():
    return random_weights(small_config(), seed=3)


def run_all(engine: Engine) -> dict[int, list]:
    events: dict[int, list] = {}
    while engine.has_unfinished():
        for event in engine.step():
            events.setdefault(event.request_id, []).append(event)
    return events


PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox jumps")]


@pytest.mark.clause("FWD-CACHE-1")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_engine_matches_naive_engine(model, temperature):
    outputs = {}
    for naive in (False, True):
        engine = Engine(model, ByteTokenizer(), naive=naive, block_size=4)
        ids = [
            engine.add_request(
                p, SamplingParams(temperature=temperature, seed=i, max_tokens=12, ignore_eos=True)
            )
            for i, p in enumerate(PROMPTS)
        ]
        run_all(engine)
        outputs[naive] = [engine.output(i).token_ids for i in ids]
    assert outputs[False] == outputs[True]
    assert all(len(t) == 12 for t in outputs[False])


@pytest.mark.clause("SAMPLE-RNG-3")
def test_seeded_request_is_batch_invariant(model):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = Engine(model, ByteTokenizer(), block_size=4)
    alone_id = alone.add_request(PROMPTS[0], params)
    run_all(alone)
    expected = alone.output(alone_id).token_ids

    # In a batch with others, at any row.
    batched = Engine(model, ByteTokenizer(), block_size=4)
    batched.add_request(PROMPTS[2], SamplingParams(temperature=1.0, seed=5, max_tokens=6))
    target = batched.add_request(PROMPTS[0], params)
    batched.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20))
    run_all(batched)
    assert batched.output(target).token_ids == expected

    # Joining a batch that is already decoding, and others joining after it.
    joining = Engine(model, ByteTokenizer(), block_size=3)
    joining.add_request(PROMPTS[2], SamplingParams(temperature=1.0, seed=9, max_tokens=15))
    for _ in range(4):
        joining.step()
    target = joining.add_request(PROMPTS[0], params)
    joining.step()
    joining.step()
    joining.add_request(PROMPTS[1], SamplingParams(temperature=0.5, seed=2, max_tokens=8))
    run_all(joining)
    assert joining.output(target).token_ids == expected


def test_requests_join_and_leave_and_blocks_return(model):
    engine = Engine(model, ByteTokenizer(), block_size=2, cache_tokens=64)
    free = engine.block_manager.allocator.num_free
    a = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    engine.step()
    b = engine.add_request(
        PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append(len(engine.scheduler.running))
    assert 2 in sizes and sizes[-1] == 0  # both decoded together, then both left
    assert engine.output(a).completion_tokens == 3 and engine.output(b).completion_tokens == 6
    assert engine.block_manager.allocator.num_free == free


def test_request_that_cannot_grow_preempts_instead_of_failing(model):
    # 10 blocks of 2 positions: two requests of 5 + up to 10 tokens cannot both fit,
    # so the later one is preempted and recomputed; both end as they would alone.
    engine = Engine(model, ByteTokenizer(), block_size=2, cache_tokens=20)
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a = engine.add_request(list(b"abcde"), long)
    b = engine.add_request(list(b"vwxyz"), long)
    run_all(engine)
    assert engine.output(a).finish_reason == engine.output(b).finish_reason == "length"
    assert engine.output(a).preemptions == 0 and engine.output(b).preemptions >= 1
    for request_id, prompt in ((a, b"abcde"), (b, b"vwxyz")):
        alone = Engine(model, ByteTokenizer())
        only = alone.add_request(list(prompt), long)
        run_all(alone)
        assert engine.output(request_id).token_ids == alone.output(only).token_ids
    assert engine.block_manager.allocator.num_free == 10


def test_waiting_request_joins_when_blocks_free_up(model):
    engine = Engine(model, ByteTokenizer(), block_size=2, cache_tokens=12)
    a = engine.add_request(
        list(b"abcdefgh"), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    b = engine.add_request(
        list(b"ijklmnop"), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    engine.step()
    assert [r.id for r in engine.scheduler.running] == [a] and [
        r.id for r in engine.scheduler.waiting
    ] == [b]
    run_all(engine)
    assert engine.output(b).finish_reason == "length"


# ---------------------------------------------------------------- stops, end to end


def run_script(script: list[int], params: SamplingParams) -> tuple[str, list[int], str, str]:
    """Generate greedily from a model whose logits are all 0, forcing each step's
    token with a logit bias: the engine's own sampling, stop and streaming run."""
    weights = random_weights(small_config(), seed=0)
    weights.output = torch.zeros_like(weights.output)
    engine = Engine(weights, ByteTokenizer())
    request_id = engine.add_request([1, 2, 3], params)
    request = engine.requests[request_id]
    streamed = []
    step = 0
    while request.finish_reason is None:
        bias = {script[step]: 50.0}
        request.logits_state.params = SamplingParams(**{**params.__dict__, "logit_bias": bias})
        for event in engine.step():
            streamed.append(event.text)
        step += 1
    out = engine.output(request_id)
    return out.text, out.token_ids, out.finish_reason, "".join(streamed)


@pytest.mark.clause("STOP-ID-1", "STOP-STR-1", "STOP-LEN-1", "STOP-STREAM-1", "STOP-ID-2")
@pytest.mark.parametrize(
    ("script", "params", "text", "ids", "reason"),
    [
        ([*list(b"hi"), 256, 65], dict(), "hi", [*list(b"hi"), 256], "stop"),
        (
            [*list(b"hi"), 256, *list(b"yo")],
            dict(ignore_eos=True, max_tokens=5),
            "hiyo",
            [*list(b"hi"), 256, *list(b"yo")],
            "length",
        ),
        (list(b"abcSTOPxyz"), dict(stop=["STOP"]), "abc", list(b"abcSTOP"), "stop"),
        (list(b"abcdef"), dict(max_tokens=4), "abcd", list(b"abcd"), "length"),
        # min_tokens bans the forced EOS at step 2: greedy takes token 0 there instead.
        (
            [*list(b"ab"), 256, *list(b"c"), 256],
            dict(min_tokens=3),
            "ab\x00c",
            [*list(b"ab\x00c"), 256],
            "stop",
        ),
        ([*list("é€".encode()), 256], dict(), "é€", [*list("é€".encode()), 256], "stop"),
    ],
)
def test_stop_behaviour_end_to_end(script, params, text, ids, reason):
    params = SamplingParams(temperature=0.0, **{"max_tokens": 64, **params})
    got_text, got_ids, got_reason, streamed = run_script(script, params)
    assert (got_text, got_ids, got_reason) == (text, ids, reason)
    assert streamed == got_text


# ---------------------------------------------------------------- bad input


@pytest.mark.clause("PARAM-REQUEST-1")
@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], SamplingParams(), "at least one"),
        (list(range(128)), SamplingParams(max_tokens=None), "no room"),
        ([1] * 100, SamplingParams(max_tokens=64), "max_tokens"),
        ([999], SamplingParams(), "vocabulary"),
    ],
)
def test_bad_requests_raise_clear_errors(model, prompt, params, match):
    engine = Engine(model, ByteTokenizer())
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_unknown_backend_is_a_clear_error(model):
    with pytest.raises(ValueError, match="unknown backend"):
        Engine(model, ByteTokenizer(), backend="cuda")


def test_triton_backend_takes_the_stages_the_kernels_provide():
    backend = get_backend("triton")
    assert {"paged_attention", "append_kv"} <= set(backend.kernel_ops)
    for op in STAGE_OPERATIONS:
        source = kernels if op in backend.kernel_ops else SPEC_BACKEND
        assert getattr(backend, op) is getattr(source, op), op


@pytest.mark.clause("FWD-CACHE-1")
@pytest.mark.parametrize("other", ["triton", "torch"])
def test_every_backend_generates_what_the_spec_backend_generates(model, other):
    """Greedy and seeded requests joining a running batch: prefill and decode rows mixed."""
    outputs = {}
    for backend in ("spec", other):
        engine = Engine(model, ByteTokenizer(), backend=backend, block_size=3)
        first = engine.add_request(
            PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        engine.step()
        engine.step()
        later = [
            engine.add_request(
                p, SamplingParams(temperature=0.9, seed=i, max_tokens=6, ignore_eos=True)
            )
            for i, p in enumerate(PROMPTS[:2])
        ]
        run_all(engine)
        outputs[backend] = [engine.output(i).token_ids for i in (first, *later)]
    assert outputs[other] == outputs["spec"]


@pytest.mark.clause("SAMPLE-VALID-2")
def test_triton_backend_fails_a_request_with_invalid_logits_alone(model):
    """The kernels' InvalidLogitsError reaches the engine like the spec's."""
    broken = dataclasses.replace(model, output=model.output.clone())
    broken.output[ord("q")] = math.nan  # NaN logit for token "q", at every position
    engine = Engine(broken, ByteTokenizer(), backend="triton", block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ok = engine.add_request(PROMPTS[0], greedy)
    run_all(engine)
    assert engine.output(ok).finish_reason == "error"
    assert "NaN or infinite logits" in engine.output(ok).error


def test_triton_backend_refuses_a_cpu_model_outside_the_interpreter(model, monkeypatch):
    monkeypatch.setattr(kernels.checks, "INTERPRET", False)
    with pytest.raises(ValueError, match="needs the model on a GPU"):
        Engine(model.to("cpu"), ByteTokenizer(), backend="triton")


def test_unseeded_request_reports_its_seed(model):
    engine = Engine(model, ByteTokenizer(), seed=11)
    rid = engine.add_request(
        PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    )
    run_all(engine)
    out = engine.output(rid)
    assert out.seed is not None
    replay = Engine(model, ByteTokenizer())
    rid2 = replay.add_request(
        PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=5, seed=out.seed, ignore_eos=True)
    )
    run_all(replay)
    assert replay.output(rid2).token_ids == out.token_ids


def test_metrics_are_reported(model):
    engine = Engine(model, ByteTokenizer())
    rid = engine.add_request(
        PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    run_all(engine)
    out = engine.output(rid)
    assert out.ttft_s > 0 and out.prompt_tokens_per_s > 0 and out.tokens_per_s > 0
    assert len(out.inter_token_latencies_s) == 5


@pytest.mark.clause("SAMPLE-SEED-1")
def test_seeds_are_drawn_by_the_engine_below_2_to_the_53(model):
    """An unseeded request gets a seed from the engine's generator (the one place seeds
    are drawn; the server draws none of its own), below 2**53 so that a JSON client
    reads the reported seed exactly, and replaying it gives the same tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    seeds = []
    for _ in range(2):
        engine = Engine(model, ByteTokenizer(), seed=11)
        ids = [engine.add_request(PROMPTS[0], params) for _ in range(8)]
        seeds.append([engine.output(i).seed for i in ids])
    assert seeds[0] == seeds[1] and len(set(seeds[0])) == 8
    assert all(0 <= seed < 2**53 for seed in seeds[0])
    engine = Engine(model, ByteTokenizer(), seed=11)
    first = engine.add_request(PROMPTS[0], params)
    replay = engine.add_request(PROMPTS[0], dataclasses.replace(params, seed=seeds[0][0]))
    while engine.has_unfinished():
        engine.step()
    assert engine.output(first).token_ids == engine.output(replay).token_ids
