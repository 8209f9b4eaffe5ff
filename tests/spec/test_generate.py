"""The spec's loop (spec/generate.py) against the loop written the slow way.

The slow way recomputes everything at every step (`forward_naive` on the
prompt and the output so far) and samples, computes logprobs and stops with
the stage functions directly. Models are small, random and float64, so the
cached and the naive logits agree to ~1e-15 and a token choice could only
differ on a tie no random draw produces.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decodespec.spec import sampling
from decodespec.spec.append import append_kv
from decodespec.spec.attention import paged_attention
from decodespec.spec.forward import ModelWeights, forward_naive
from decodespec.spec.generate import (
    StepOutput,
    TokenLogprobs,
    decode_one_token,
    generate,
    prefill,
)
from decodespec.spec.params import SamplingParams, SamplingTensors, resolve_seed, sampling_tensors
from decodespec.spec.sampling import InvalidLogitsError
from decodespec.spec.stop import StopChecker
from tests.engine.toy import ByteTokenizer, random_weights, small_config

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids[0]
SPECIAL = 257  # no text
MAX_CONTEXT = 40

# Small float64 models: grouped-query attention; multi-head with attention bias
# and tied embeddings; one layer with a single KV head.
MODELS = [
    random_weights(small_config(max_context=MAX_CONTEXT), seed=1, dtype=torch.float64),
    random_weights(
        small_config(
            max_context=MAX_CONTEXT,
            num_heads=4,
            num_kv_heads=4,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
        seed=2,
        dtype=torch.float64,
    ),
    random_weights(
        small_config(max_context=MAX_CONTEXT, num_layers=1, num_kv_heads=1),
        seed=3,
        dtype=torch.float64,
    ),
]
VOCAB = MODELS[0].config.vocab_size


def run(weights: ModelWeights, prompt: list[int], params: SamplingParams, **stages) -> list:
    return list(
        generate(
            weights,
            prompt,
            params,
            eos_token_ids=TOKENIZER.eos_token_ids,
            token_bytes=TOKENIZER.token_bytes,
            **stages,
        )
    )


def naive_logits(weights: ModelWeights, ids: list[int]) -> torch.Tensor:
    """`[1, vocab]` logits after the last of `ids`, everything recomputed."""
    return forward_naive(weights, torch.tensor(ids), last_only=True)


def step_tensors(params: SamplingParams, prompt: list[int], output: list[int]) -> SamplingTensors:
    return sampling_tensors(
        [params],
        vocab_size=VOCAB,
        prompt_token_ids=[prompt],
        output_token_ids=[output],
        eos_token_ids=TOKENIZER.eos_token_ids,
    )


def slow_loop(weights: ModelWeights, prompt: list[int], params: SamplingParams) -> list:
    """The loop the slow way: `forward_naive` over everything, every step."""
    checker = StopChecker(
        params,
        eos_token_ids=TOKENIZER.eos_token_ids,
        token_bytes=TOKENIZER.token_bytes,
        prompt_len=len(prompt),
        max_context=weights.config.max_context,
    )
    steps: list[StepOutput] = []
    while checker.finish_reason is None:
        output = checker.token_ids
        logits = naive_logits(weights, prompt + output)
        tensors = step_tensors(params, prompt, output)
        token = int(sampling.sample(logits, **tensors)[0])
        logprobs = None
        if params.top_logprobs is not None:
            lp = torch.log_softmax(logits[0], dim=-1)
            if params.logprobs_mode == "processed":
                args = {k: v for k, v in tensors.items() if k != "seed"}
                lp = torch.log_softmax(sampling.process_logits(logits, **args)[0], dim=-1)
            order = sorted(range(VOCAB), key=lambda i: (-lp[i].item(), i))
            logprobs = TokenLogprobs(
                token,
                lp[token].item(),
                1 + int((lp > lp[token]).sum()),
                [(i, lp[i].item()) for i in order[: params.top_logprobs]],
            )
        delta = checker.append(token)
        steps.append(StepOutput(token, delta.text, delta.finish_reason, logprobs))
    return steps


def nan_cache(weights: ModelWeights, positions: int, block_size: int) -> list:
    config = weights.config
    shape = (-(-positions // block_size), block_size, config.num_kv_heads, config.head_dim)
    return [
        (
            torch.full(shape, math.nan, dtype=weights.dtype),
            torch.full(shape, math.nan, dtype=weights.dtype),
        )
        for _ in range(config.num_layers)
    ]


@dataclass
class Spy:
    """Stage functions that record their calls and otherwise are the spec's."""

    forced: list[int] = field(default_factory=list)  # tokens to emit instead of sampling
    poison_step: int | None = None  # the step whose logits get a NaN
    sample_calls: list[tuple[torch.Tensor, dict]] = field(default_factory=list)
    append_calls: int = 0
    caches: list[torch.Tensor] = field(default_factory=list)

    def sample(self, logits: torch.Tensor, **tensors: torch.Tensor) -> torch.Tensor:
        self.sample_calls.append((logits.clone(), tensors))
        step = int(tensors["step"][0])
        if step == self.poison_step:
            logits = logits.clone()
            logits[0, 0] = math.nan
        token = sampling.sample(logits, **tensors)
        if step < len(self.forced):
            return torch.tensor([self.forced[step]])
        return token

    def append(self, key, value, k_cache, v_cache, slot_mapping, *, validate=True) -> None:
        self.append_calls += 1
        self.caches.append(k_cache)
        append_kv(key, value, k_cache, v_cache, slot_mapping, validate=validate)

    def attention(self, q, k_cache, v_cache, block_table, seq_lens, query_start, **kw):
        # Every position of the sequence is written, every later slot still poisoned.
        written = int(seq_lens[0])
        for cache in (k_cache, v_cache):
            flat = cache.flatten(0, 1)
            assert not flat[:written].isnan().any()
            assert flat[written:].isnan().all()
        return paged_attention(q, k_cache, v_cache, block_table, seq_lens, query_start, **kw)

    def stages(self) -> dict:
        return {"sample": self.sample, "append": self.append, "attention": self.attention}


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
models = st.sampled_from(MODELS)
block_sizes = st.sampled_from([1, 2, 3, 5, 16])


# ---------------------------------------------------------------------------
# Prefill and decode


@pytest.mark.clause("LOOP-PREFILL-1", "LOOP-DECODE-1")
@settings(max_examples=20)
@given(models, prompts, block_sizes, st.integers(1, 10))
def test_greedy_tokens_are_the_argmax_loop_over_forward_naive(
    weights, prompt, block_size, max_tokens
):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps = run(weights, prompt, params, block_size=block_size)
    expected: list[int] = []
    for _ in range(max_tokens):
        expected.append(int(naive_logits(weights, prompt + expected)[0].argmax()))
    assert [s.token_id for s in steps] == expected
    assert [s.finish_reason for s in steps] == [None] * (max_tokens - 1) + ["length"]


@pytest.mark.clause("LOOP-PREFILL-1", "LOOP-DECODE-1")
@settings(max_examples=10)
@given(models, prompts, block_sizes, st.lists(st.integers(0, VOCAB - 1), max_size=6))
def test_prefill_and_decode_one_token_give_forward_naive_logits(weights, prompt, block_size, more):
    cache = nan_cache(weights, len(prompt) + len(more) + 1, block_size)
    logits = prefill(weights, cache, prompt)
    assert logits.shape == (VOCAB,)
    torch.testing.assert_close(logits, naive_logits(weights, prompt)[0], rtol=1e-10, atol=1e-10)
    # The prompt's K/V sit in slots 0 .. n-1; the rest is still poison.
    k_cache = cache[0][0].flatten(0, 1)
    assert not k_cache[: len(prompt)].isnan().any() and k_cache[len(prompt) :].isnan().all()
    sequence = list(prompt)
    for token in more:
        logits = decode_one_token(weights, cache, token, len(sequence))
        sequence.append(token)
        expected = naive_logits(weights, sequence)[0]
        torch.testing.assert_close(logits, expected, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------
# The cache


@pytest.mark.clause("LOOP-CACHE-1")
@settings(max_examples=8)
@given(models, prompts, block_sizes, st.none() | st.integers(1, 8))
def test_the_loop_reads_only_written_slots_of_its_poisoned_cache(
    weights, prompt, block_size, max_tokens
):
    if max_tokens is not None:
        max_tokens = min(max_tokens, MAX_CONTEXT - len(prompt))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spy = Spy()
    steps = run(weights, prompt, params, block_size=block_size, **spy.stages())
    capacity = MAX_CONTEXT if max_tokens is None else len(prompt) + max_tokens
    config = weights.config
    shape = (-(-capacity // block_size), block_size, config.num_kv_heads, config.head_dim)
    assert {tuple(c.shape) for c in spy.caches} == {shape}
    assert {c.dtype for c in spy.caches} == {weights.dtype}
    assert all(call[0].isfinite().all() for call in spy.sample_calls)
    # The tokens do not depend on the cache's block size.
    same = run(weights, prompt, params, block_size=4)
    assert [s.token_id for s in steps] == [s.token_id for s in same]


# ---------------------------------------------------------------------------
# Sampling


@st.composite
def sampled_params(draw: st.DrawFn, **fixed) -> SamplingParams:
    max_tokens = draw(st.integers(1, 10))
    values = dict(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 1, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        presence_penalty=draw(st.sampled_from([0.0, 1.0])),
        logit_bias=draw(
            st.dictionaries(
                st.integers(0, VOCAB - 1), st.sampled_from([-5.0, -0.5, 1.5, 4.0]), max_size=3
            )
        ),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        seed=draw(st.integers(0, 2**64 - 1)),
        stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
        ignore_eos=draw(st.booleans()),
    )
    values.update(fixed)
    return SamplingParams(**values)


@pytest.mark.clause("LOOP-SAMPLE-1")
@settings(max_examples=15)
@given(models, prompts, sampled_params())
def test_sampled_tokens_are_the_slow_loops(weights, prompt, params):
    steps = run(weights, prompt, params)
    assert steps == slow_loop(weights, prompt, params)


@pytest.mark.clause("LOOP-SAMPLE-1", "LOOP-DECODE-1")
@settings(max_examples=10)
@given(models, prompts, sampled_params(), st.lists(st.integers(0, 255), max_size=10))
def test_sample_is_called_with_the_steps_raw_logits_and_tensors(weights, prompt, params, forced):
    spy = Spy(forced=forced)
    steps = run(weights, prompt, params, **spy.stages())
    output = [s.token_id for s in steps]
    assert output[: len(forced)] == forced[: len(output)]
    assert len(spy.sample_calls) == len(steps)
    for t, (logits, tensors) in enumerate(spy.sample_calls):
        # The raw logits after prompt + output[:t], whatever tokens were emitted before.
        assert logits.shape == (1, VOCAB)
        expected_logits = naive_logits(weights, prompt + output[:t])
        torch.testing.assert_close(logits, expected_logits, rtol=1e-10, atol=1e-10)
        expected = step_tensors(params, prompt, output[:t])
        assert tensors.keys() == expected.keys()
        assert int(tensors["step"][0]) == t
        for name, value in expected.items():
            assert torch.equal(tensors[name], value), name


# ---------------------------------------------------------------------------
# Logprobs


@pytest.mark.clause("LOOP-LOGPROB-1")
@settings(max_examples=15)
@given(
    models,
    prompts,
    sampled_params(top_logprobs=None),
    st.none() | st.integers(0, 20),
    st.sampled_from(["raw", "processed"]),
)
def test_logprobs_are_those_of_the_raw_or_processed_logits(weights, prompt, params, n, mode):
    params = SamplingParams(**{**vars(params), "top_logprobs": n, "logprobs_mode": mode})
    steps = run(weights, prompt, params)
    slow = slow_loop(weights, prompt, params)
    assert [s.token_id for s in steps] == [s.token_id for s in slow]
    for ours, theirs in zip(steps, slow, strict=True):
        if n is None:
            assert ours.logprobs is None
            continue
        lp = ours.logprobs
        assert isinstance(lp.logprob, float) and isinstance(lp.rank, int)
        assert lp.token_id == ours.token_id and len(lp.top) == n
        assert lp.logprob == pytest.approx(theirs.logprobs.logprob, abs=1e-9)
        assert lp.rank == theirs.logprobs.rank
        assert [i for i, _ in lp.top] == [i for i, _ in theirs.logprobs.top]
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in theirs.logprobs.top])


@pytest.mark.clause("LOOP-LOGPROB-1")
def test_processed_logprobs_drop_the_filtered_tokens():
    prompt = [1, 2, 3]
    raw = run(MODELS[0], prompt, SamplingParams(temperature=1.0, top_k=2, seed=7, top_logprobs=4))
    processed = run(
        MODELS[0],
        prompt,
        SamplingParams(temperature=1.0, top_k=2, seed=7, top_logprobs=4, logprobs_mode="processed"),
    )
    assert [s.token_id for s in raw] == [s.token_id for s in processed]
    for r, p in zip(raw, processed, strict=True):
        assert all(v > -math.inf for _, v in r.logprobs.top)
        assert [v for _, v in p.logprobs.top[2:]] == [-math.inf, -math.inf]
        assert p.logprobs.rank <= 2 and p.logprobs.logprob >= r.logprobs.logprob


# ---------------------------------------------------------------------------
# Stop

# Byte tokens whose texts make stop strings, split UTF-8 ("é" is c3 a9), EOS, a special.
FORCEABLE = [*b"ab \n", 0xC3, 0xA9, EOS, SPECIAL]


@pytest.mark.clause("LOOP-STOP-1")
@settings(max_examples=40)
@given(
    st.lists(st.sampled_from(FORCEABLE), max_size=14),
    st.lists(st.sampled_from(["b", "ab", " a", "\n\n", "é", "a b"]), max_size=2),
    st.none() | st.integers(1, 12),
    st.integers(0, 3),
    st.booleans(),
)
def test_the_loop_streams_the_stop_checkers_deltas_until_it_finishes(
    forced, stop, max_tokens, min_tokens, ignore_eos
):
    params = SamplingParams(
        temperature=0.0,
        stop=stop,
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens or min_tokens),
        ignore_eos=ignore_eos,
    )
    prompt = [5, 6, 7]
    spy = Spy(forced=forced)
    steps = run(MODELS[2], prompt, params, **spy.stages())
    tokens = [s.token_id for s in steps]
    assert tokens[: len(forced)] == forced[: len(tokens)]
    checker = StopChecker(
        params,
        eos_token_ids=TOKENIZER.eos_token_ids,
        token_bytes=TOKENIZER.token_bytes,
        prompt_len=len(prompt),
        max_context=MAX_CONTEXT,
    )
    deltas = [checker.append(t) for t in tokens]
    assert [(s.text, s.finish_reason) for s in steps] == [(d.text, d.finish_reason) for d in deltas]
    # It ends at the first finish reason, and nothing runs after it.
    assert checker.finish_reason is not None
    assert all(s.finish_reason is None for s in steps[:-1])
    assert "".join(s.text for s in steps) == checker.text
    assert len(spy.sample_calls) == len(steps)
    assert spy.append_calls == len(steps) * MODELS[2].config.num_layers


@pytest.mark.clause("LOOP-STOP-1")
@pytest.mark.parametrize(
    ("forced", "params", "reason", "text"),
    [
        ([*b"hi", EOS, *b"x"], SamplingParams(temperature=0.0, max_tokens=8), "stop", "hi"),
        (
            [*b"hi", EOS],
            SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=3),
            "length",
            "hi",
        ),
        (
            [*b"say stop now"],
            SamplingParams(temperature=0.0, stop=["stop"], max_tokens=20),
            "stop",
            "say ",
        ),
        ([*b"abcdef"], SamplingParams(temperature=0.0, max_tokens=4), "length", "abcd"),
    ],
)
def test_finish_reasons(forced, params, reason, text):
    steps = run(MODELS[0], [1, 2], params, **Spy(forced=forced).stages())
    assert steps[-1].finish_reason == reason
    assert "".join(s.text for s in steps) == text


@pytest.mark.clause("LOOP-STOP-1", "LOOP-CACHE-1")
def test_max_tokens_none_runs_until_the_context_is_full():
    prompt = list(range(30))
    steps = run(
        MODELS[1], prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    )
    assert len(steps) == MAX_CONTEXT - len(prompt)
    assert steps[-1].finish_reason == "length"


# ---------------------------------------------------------------------------
# Invalid logits


@pytest.mark.clause("LOOP-VALID-1")
def test_invalid_logits_raise_after_the_steps_already_streamed():
    spy = Spy(poison_step=2)
    stream = generate(
        MODELS[0],
        [1, 2, 3],
        SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True),
        eos_token_ids=TOKENIZER.eos_token_ids,
        token_bytes=TOKENIZER.token_bytes,
        **spy.stages(),
    )
    assert len([next(stream), next(stream)]) == 2
    with pytest.raises(InvalidLogitsError) as error:
        next(stream)
    assert error.value.rows == [0]
    assert len(spy.sample_calls) == 3


@pytest.mark.clause("LOOP-VALID-1")
def test_a_model_with_nan_logits_raises_before_any_step():
    good = MODELS[0]
    output = good.output.clone()
    output[17] = math.nan
    weights = ModelWeights(good.config, good.embedding, good.layers, good.final_norm, output)
    with pytest.raises(InvalidLogitsError):
        run(weights, [1, 2, 3], SamplingParams(temperature=0.0))


# ---------------------------------------------------------------------------
# The request


@pytest.mark.clause("LOOP-REQUEST-1")
@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(temperature=0.0), "at least one token"),
        ([1, VOCAB], SamplingParams(temperature=0.0), "outside the vocabulary"),
        ([1, -1], SamplingParams(temperature=0.0), "outside the vocabulary"),
        (list(range(MAX_CONTEXT)), SamplingParams(temperature=0.0), "no room"),
        ([1, 2], SamplingParams(temperature=0.0, max_tokens=MAX_CONTEXT - 1), "exceeds"),
        ([1, 2], SamplingParams(temperature=0.0, stop_token_ids=[VOCAB]), "stop_token_ids"),
        ([1, 2], SamplingParams(temperature=0.0, logit_bias={VOCAB + 3: 1.0}), "logit_bias"),
        ([1, 2], SamplingParams(temperature=0.7), "resolve the seed first"),
    ],
)
def test_invalid_requests_raise_before_the_model_runs(prompt, params, message):
    spy = Spy()
    with pytest.raises(ValueError, match=message):
        run(MODELS[0], prompt, params, **spy.stages())
    assert spy.append_calls == 0 and not spy.sample_calls


@pytest.mark.clause("LOOP-REQUEST-1")
def test_greedy_needs_no_seed_and_a_resolved_seed_replays():
    assert run(MODELS[0], [1, 2], SamplingParams(temperature=0.0, max_tokens=3))
    params = resolve_seed(
        SamplingParams(temperature=1.0, max_tokens=6), torch.Generator().manual_seed(0)
    )
    assert run(MODELS[0], [1, 2], params) == run(MODELS[0], [1, 2], params)
    with pytest.raises(ValueError, match="block_size"):
        run(MODELS[0], [1, 2], params, block_size=0)
