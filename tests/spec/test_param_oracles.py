"""Each sampling parameter against an oracle that shares no code with what it judges.

The spec's loop (LOOP-SAMPLE-1), the engine's sampler and the slow loops of
the other tests all build their per-row tensors with
`decodespec.spec.params.sampling_tensors`, so a parameter that becomes the
wrong tensor (dropped, swapped with another, on the wrong token, on the wrong
row) goes unseen when they are compared with one another. Here the real paths

- the spec's: `sampling_tensors` then `process_logits` (and `sample`),
- the engine's: `Sampler.tensors` over `LogitsState`s then `Sampler.process`,
- the loop's: `generate` on a small float64 model,

are compared with `tests.param_oracle`, which evaluates the clauses by hand
in Python floats from the `SamplingParams` fields alone. The oracle itself is
pinned by rows computed by hand below (tiny vocabularies, exact numbers) and,
where transformers is installed, by Hugging Face's logits processors.

Logits are float64, so the oracle's arithmetic is the spec's operation for
operation: values must agree to 1e-12, kept sets exactly, except a token whose
top-p or min-p statistic the oracle finds within `param_oracle.NEAR` of its
threshold (another summation order may decide it either way).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from decodespec.reference.backend import SPEC_BACKEND
from decodespec.reference.logits_state import LogitsState
from decodespec.reference.sampler import Sampler
from decodespec.spec import params as spec_params
from decodespec.spec.forward import forward_naive
from decodespec.spec.generate import generate
from decodespec.spec.params import SamplingParams, SamplingTensors
from decodespec.spec.rng import philox4x32
from decodespec.spec.rng import uniform as spec_uniform
from decodespec.spec.sampling import InvalidLogitsError, process_logits, sample
from tests import param_oracle as oracle
from tests.engine.toy import ByteTokenizer, random_weights, small_config

INF = math.inf
RTOL = 1e-12

# ---------------------------------------------------------------------------
# The real paths and the comparison


def _split(requests: list[tuple[SamplingParams, list[int], list[int]]]) -> tuple:
    params, prompts, outputs = zip(*requests, strict=True)
    return list(params), [list(p) for p in prompts], [list(o) for o in outputs]


def spec_tensors(requests: list, vocab: int, eos: tuple[int, ...]) -> SamplingTensors:
    """The spec's tensors (looked up at call time, so a test can break the builder)."""
    params, prompts, outputs = _split(requests)
    return spec_params.sampling_tensors(
        params,
        vocab_size=vocab,
        prompt_token_ids=prompts,
        output_token_ids=outputs,
        eos_token_ids=eos,
    )


def spec_rows(requests: list, logits: torch.Tensor, eos: tuple[int, ...]) -> torch.Tensor:
    """The spec's path: `sampling_tensors`, then `process_logits` (LOOP-SAMPLE-1)."""
    tensors = spec_tensors(requests, logits.shape[1], eos)
    return process_logits(logits, **tensors.process_logits_args)


def engine_rows(requests: list, logits: torch.Tensor, eos: tuple[int, ...]) -> tuple:
    """The engine's path: the sampler's tensors from each request's `LogitsState`,
    then its `process` (invalid rows come back as reasons)."""
    sampler = Sampler(SPEC_BACKEND, logits.shape[1], eos)
    states = [LogitsState(p, list(prompt)) for p, prompt, _ in requests]
    tensors = sampler.tensors(states, [list(out) for _, _, out in requests], logits.device)
    return sampler.process(logits, tensors)


def oracle_row(request: tuple, logits: list[float], eos: tuple[int, ...]) -> oracle.Row:
    params, prompt, output = request
    return oracle.processed(params, logits, prompt=prompt, output=output, eos_token_ids=eos)


def assert_row(got: torch.Tensor, want: oracle.Row, what: str) -> None:
    """The real path's row equals the oracle's: same −inf entries, values to RTOL."""
    got_values = got.tolist()
    wrong = []
    for i, (g, w) in enumerate(zip(got_values, want.values, strict=True)):
        if i in want.near:
            continue
        if g == -INF or w == -INF:
            same = g == w
        else:
            same = abs(g - w) <= RTOL * max(1.0, abs(w))
        if not same:
            wrong.append((i, g, w))
    if wrong:
        raise AssertionError(
            f"{what}: (token, real path, oracle) differ at {wrong[:6]}\n"
            f"  real path {got_values}\n  oracle    {want.values}"
        )


def assert_values(got: list[float], want: list[float], what: str) -> None:
    assert_row(torch.tensor(got, dtype=torch.float64), oracle.Row(list(want)), what)


# ---------------------------------------------------------------------------
# Rows computed by hand: they pin the oracle, and the real paths against them

# Vocabulary of 6; prompt [0, 1], output [2, 2, 3] (token 2 twice), EOS 5.
L6 = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
PROMPT6, OUTPUT6, EOS6 = [0, 1], [2, 2, 3], (5,)

# (id, SamplingParams fields, the row after the processors, steps 1-3), greedy.
PROCESSOR_CASES = [
    ("bias", {"logit_bias": {4: 10.0, 0: -1.5}}, [0.5, -1.0, 0.5, 3.0, 8.0, 0.0]),
    ("min_tokens-held", {"min_tokens": 4, "stop_token_ids": [1]}, [2, -INF, 0.5, 3, -2, -INF]),
    ("min_tokens-reached", {"min_tokens": 3, "stop_token_ids": [1]}, L6),
    (
        "min_tokens-ignore_eos",
        {"min_tokens": 4, "stop_token_ids": [1], "ignore_eos": True},
        [2, -INF, 0.5, 3, -2, 0],
    ),
    # prompt ∪ output = {0, 1, 2, 3}: positive divided, negative multiplied; 4 and 5 untouched.
    ("repetition-2", {"repetition_penalty": 2.0}, [1.0, -2.0, 0.25, 1.5, -2.0, 0.0]),
    ("repetition-0.5", {"repetition_penalty": 0.5}, [4.0, -0.5, 1.0, 6.0, -2.0, 0.0]),
    # counts in the output {2: 2, 3: 1}; prompt tokens 0, 1 untouched.
    ("frequency", {"frequency_penalty": 0.5}, [2.0, -1.0, -0.5, 2.5, -2.0, 0.0]),
    ("frequency-negative", {"frequency_penalty": -1.0}, [2.0, -1.0, 2.5, 4.0, -2.0, 0.0]),
    ("presence", {"presence_penalty": 0.5}, [2.0, -1.0, 0.0, 2.5, -2.0, 0.0]),
    ("presence-negative", {"presence_penalty": -2.0}, [2.0, -1.0, 2.5, 5.0, -2.0, 0.0]),
    (
        "frequency-and-presence",
        {"frequency_penalty": 0.5, "presence_penalty": 0.25},
        [2.0, -1.0, -0.75, 2.25, -2.0, 0.0],
    ),
    # bias z0 = 4, EOS banned, repetition halves the biased z0 (2, not 1 + 2), then
    # frequency and presence: z2 = 0.25 - 1 - 0.25, z3 = 1.5 - 0.5 - 0.25.
    (
        "all-in-order",
        {
            "logit_bias": {0: 2.0},
            "min_tokens": 4,
            "repetition_penalty": 2.0,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.25,
        },
        [2.0, -2.0, -1.0, 0.75, -2.0, -INF],
    ),
]
PROCESSOR_CLAUSES = {
    "bias": ("LOGITS-BIAS-1",),
    "min_tokens-held": ("LOGITS-MINTOK-1",),
    "min_tokens-reached": ("LOGITS-MINTOK-1",),
    "min_tokens-ignore_eos": ("LOGITS-MINTOK-1",),
    "repetition-2": ("LOGITS-REP-1",),
    "repetition-0.5": ("LOGITS-REP-1",),
    "frequency": ("LOGITS-FREQ-1",),
    "frequency-negative": ("LOGITS-FREQ-1",),
    "presence": ("LOGITS-PRES-1",),
    "presence-negative": ("LOGITS-PRES-1",),
    "frequency-and-presence": ("LOGITS-FREQ-1", "LOGITS-PRES-1"),
    "all-in-order": (
        "LOGITS-ORDER-1",
        "LOGITS-BIAS-1",
        "LOGITS-MINTOK-1",
        "LOGITS-REP-1",
        "LOGITS-FREQ-1",
        "LOGITS-PRES-1",
    ),
}

Z5 = [3.0, 1.0, 2.0, 0.0, 2.0]  # token 2 and 4 tie
P4 = [math.log(x) for x in (0.5, 0.25, 0.125, 0.125)]  # tokens 2 and 3 tie
M4 = [math.log(x) for x in (4.0, 2.0, 1.0, 0.5)]
Q4 = [math.log(x) for x in (0.4, 0.3, 0.2, 0.1)]


def _shifted(z: list[float], keep: list[int] | None = None) -> list[float]:
    top = max(z)
    return [x - top if keep is None or i in keep else -INF for i, x in enumerate(z)]


# (id, fields, logits, processed row: steps 1-8, as `process_logits` returns it)
FILTER_CASES = [
    ("temperature-0.5", {"temperature": 0.5}, Z5, [0.0, -4.0, -2.0, -6.0, -2.0]),
    ("greedy", {"temperature": 0.0}, Z5, [0.0, -2.0, -1.0, -3.0, -1.0]),
    (
        "greedy-unfiltered",
        {"temperature": 0.0, "top_k": 1, "top_p": 0.1, "min_p": 0.9},
        Z5,
        [0.0, -2.0, -1.0, -3.0, -1.0],
    ),
    # #{above}: 0, 3, 1, 4, 1: k = 2 keeps token 0 and both tied tokens 2 and 4.
    ("top_k-2", {"top_k": 2}, Z5, [0.0, -INF, -1.0, -INF, -1.0]),
    ("top_k-1", {"top_k": 1}, Z5, [0.0, -INF, -INF, -INF, -INF]),
    ("top_k-beyond-vocab", {"top_k": 9}, Z5, [0.0, -2.0, -1.0, -3.0, -1.0]),
    # mass above: 0, 0.5, 0.75, 0.75
    ("top_p-0.6", {"top_p": 0.6}, P4, _shifted(P4, [0, 1])),
    ("top_p-0.8-ties", {"top_p": 0.8}, P4, _shifted(P4)),
    ("top_p-0.4", {"top_p": 0.4}, P4, _shifted(P4, [0])),
    # mass above 0, 0.4, 0.7, 0.9; after top-k 2 the renormalised mass above token 1 is 4/7
    ("top_p-0.5", {"top_p": 0.5}, Q4, _shifted(Q4, [0, 1])),
    ("top_k-then-top_p", {"top_k": 2, "top_p": 0.5}, Q4, _shifted(Q4, [0])),
    # ratios to the maximum: 1, 0.5, 0.25, 0.125
    ("min_p-0.3", {"min_p": 0.3}, M4, _shifted(M4, [0, 1])),
    ("min_p-0.2", {"min_p": 0.2}, M4, _shifted(M4, [0, 1, 2])),
    # ratios 0.75, 0.5, 0.25: top-k 3 keeps 0, 1, 2; min-p 0.6 keeps 0, 1
    ("top_k-then-min_p", {"top_k": 3, "min_p": 0.6}, Q4, _shifted(Q4, [0, 1])),
    # at T = 0.5 the ratios square: 1, 0.25, ...: min-p 0.3 keeps token 0 alone
    (
        "temperature-then-min_p",
        {"temperature": 0.5, "min_p": 0.3},
        M4,
        [0.0, -INF, -INF, -INF],
    ),
]
FILTER_CLAUSES = {
    "temperature-0.5": ("SOFTMAX-TEMP-1",),
    "greedy": ("SAMPLE-GREEDY-1",),
    "greedy-unfiltered": ("SAMPLE-GREEDY-1",),
    "top_k-2": ("SAMPLE-TOPK-1", "SAMPLE-TOPK-2"),
    "top_k-1": ("SAMPLE-TOPK-1",),
    "top_k-beyond-vocab": ("SAMPLE-TOPK-1",),
    "top_p-0.6": ("SAMPLE-TOPP-1",),
    "top_p-0.8-ties": ("SAMPLE-TOPP-1", "SAMPLE-TOPP-2"),
    "top_p-0.4": ("SAMPLE-TOPP-1",),
    "top_p-0.5": ("SAMPLE-TOPP-1",),
    "top_k-then-top_p": ("SAMPLE-ORDER-1", "SAMPLE-TOPP-1"),
    "min_p-0.3": ("SAMPLE-MINP-1",),
    "min_p-0.2": ("SAMPLE-MINP-1",),
    "top_k-then-min_p": ("SAMPLE-ORDER-1", "SAMPLE-MINP-1"),
    "temperature-then-min_p": ("SAMPLE-ORDER-1", "SOFTMAX-TEMP-1", "SAMPLE-MINP-1"),
}


def hand_cases() -> list[tuple]:
    """Every hand case as (id, params, logits, prompt, output, eos, processed row)."""
    cases = []
    for name, fields, after_processors in PROCESSOR_CASES:
        params = SamplingParams(temperature=0.0, **fields)
        cases.append((name, params, L6, PROMPT6, OUTPUT6, EOS6, _shifted(after_processors)))
    for name, fields, logits, row in FILTER_CASES:
        params = SamplingParams(**{"seed": 1, **fields})
        cases.append((name, params, logits, [0], [], (), row))
    return cases


CLAUSES = {**PROCESSOR_CLAUSES, **FILTER_CLAUSES}
HAND = [pytest.param(*c, id=c[0], marks=pytest.mark.clause(*CLAUSES[c[0]])) for c in hand_cases()]


@pytest.mark.parametrize(
    ("name", "fields", "after_processors"),
    [pytest.param(*c, id=c[0], marks=pytest.mark.clause(*CLAUSES[c[0]])) for c in PROCESSOR_CASES],
)
def test_oracle_processors_match_the_rows_computed_by_hand(name, fields, after_processors):
    params = SamplingParams(temperature=0.0, **fields)
    z = oracle.apply_processors(params, L6, prompt=PROMPT6, output=OUTPUT6, eos_token_ids=EOS6)
    assert_values(z, after_processors, f"oracle, {name}")


@pytest.mark.parametrize(("name", "params", "logits", "prompt", "output", "eos", "row"), HAND)
def test_hand_rows_pin_the_oracle_and_both_real_paths(
    name, params, logits, prompt, output, eos, row
):
    want = oracle_row((params, prompt, output), logits, eos)
    assert_values(want.values, row, f"oracle, {name}")
    assert not want.near, want.near
    requests = [(params, prompt, output)]
    z = torch.tensor([logits], dtype=torch.float64)
    assert_row(spec_rows(requests, z, eos)[0], want, f"spec path, {name}")
    processed, reasons = engine_rows(requests, z, eos)
    assert reasons == [None]
    assert_row(processed[0], want, f"engine path, {name}")


# ---------------------------------------------------------------------------
# A builder broken on purpose is caught by the hand rows alone


def _without(t: SamplingTensors, names: tuple[str, ...]) -> SamplingTensors:
    return SamplingTensors(**{k: v for k, v in t.items() if k not in names})


def _with(t: SamplingTensors, **changed: torch.Tensor) -> SamplingTensors:
    return SamplingTensors(**{**dict(t.items()), **changed})


PENALTY_TENSORS = (
    "prompt_mask",
    "output_counts",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def _presence_alone_dropped(t: SamplingTensors) -> SamplingTensors:
    if "presence_penalty" in t and bool(
        (t["repetition_penalty"] == 1).all() & (t["frequency_penalty"] == 0).all()
    ):
        return _without(t, PENALTY_TENSORS)
    return t


BROKEN_BUILDERS = {
    "presence-alone-dropped": _presence_alone_dropped,
    "frequency-presence-swapped": lambda t: (
        _with(t, frequency_penalty=t["presence_penalty"], presence_penalty=t["frequency_penalty"])
        if "presence_penalty" in t
        else t
    ),
    "min_tokens-ignored": lambda t: _without(t, ("stop_token_mask", "min_tokens")),
    "bias-on-the-next-token": lambda t: (
        _with(t, logit_bias=t["logit_bias"].roll(1, dims=1)) if "logit_bias" in t else t
    ),
    "prompt-not-penalised": lambda t: (
        _with(t, prompt_mask=torch.zeros_like(t["prompt_mask"])) if "prompt_mask" in t else t
    ),
    "step-off-by-one": lambda t: _with(t, step=t["step"] + 1),
    "temperature-ignored": lambda t: _with(
        t, temperature=torch.where(t["temperature"] > 0, 1.0, 0.0)
    ),
    "top_k-off-by-one": lambda t: _with(t, top_k=torch.where(t["top_k"] > 0, t["top_k"] + 1, 0)),
    "top_p-dropped": lambda t: _with(t, top_p=torch.ones_like(t["top_p"])),
    "min_p-dropped": lambda t: _with(t, min_p=torch.zeros_like(t["min_p"])),
    "top_p-from-min_p": lambda t: _with(t, top_p=torch.where(t["min_p"] > 0, t["min_p"], 1.0)),
}


@pytest.mark.clause(
    "LOGITS-BIAS-1",
    "LOGITS-MINTOK-1",
    "LOGITS-REP-1",
    "LOGITS-FREQ-1",
    "LOGITS-PRES-1",
    "SOFTMAX-TEMP-1",
    "SAMPLE-TOPK-1",
    "SAMPLE-TOPP-1",
    "SAMPLE-MINP-1",
)
@pytest.mark.parametrize("broken", sorted(BROKEN_BUILDERS))
def test_the_hand_rows_catch_a_broken_builder(broken, monkeypatch):
    real = spec_params.sampling_tensors

    def builder(*args, **kwargs):
        return BROKEN_BUILDERS[broken](real(*args, **kwargs))

    monkeypatch.setattr(spec_params, "sampling_tensors", builder)
    caught = []
    for name, params, logits, prompt, output, eos, _ in hand_cases():
        want = oracle_row((params, prompt, output), logits, eos)
        got = spec_rows(
            [(params, prompt, output)], torch.tensor([logits], dtype=torch.float64), eos
        )
        try:
            assert_row(got[0], want, name)
        except AssertionError:
            caught.append(name)
    assert caught, f"no hand row catches a builder with {broken}"


# ---------------------------------------------------------------------------
# Random rows: each parameter on its own, then any combination in a batch

VOCAB = st.integers(2, 12)


def decimals(low: int, high: int, scale: int = 1000) -> st.SearchStrategy[float]:
    """Numbers k / scale in [low / scale, high / scale] (mostly not float32 numbers)."""
    return st.integers(low, high).map(lambda k: k / scale)


def logits_rows(vocab: int) -> st.SearchStrategy[list[float]]:
    """A row on a coarse grid (many ties) or anywhere in [-8, 8]."""
    grid = st.integers(-12, 12).map(lambda k: k / 4)
    anywhere = st.floats(-8, 8, allow_nan=False, allow_infinity=False)
    return st.lists(st.one_of(grid, anywhere), min_size=vocab, max_size=vocab)


def token_ids(vocab: int) -> st.SearchStrategy[int]:
    return st.integers(0, vocab - 1)


def parameter_values(name: str, vocab: int) -> st.SearchStrategy:
    ids = token_ids(vocab)
    return {
        "temperature": st.one_of(st.sampled_from([0.0, 0.5, 2.0]), decimals(50, 4000)),
        "top_k": st.integers(0, vocab + 1),
        "top_p": st.one_of(st.sampled_from([0.3, 0.9, 1.0]), decimals(10, 1000)),
        "min_p": st.one_of(st.sampled_from([0.0, 0.5, 1.0]), decimals(0, 1000)),
        "repetition_penalty": st.one_of(st.sampled_from([0.5, 2.0]), decimals(200, 5000)),
        "frequency_penalty": decimals(-2000, 2000),
        "presence_penalty": decimals(-2000, 2000),
        "logit_bias": st.dictionaries(ids, decimals(-100_000, 100_000), min_size=1, max_size=4),
        "min_tokens": st.integers(1, 6),
    }[name]


PARAMETERS = {
    "temperature": ("SOFTMAX-TEMP-1", "SAMPLE-GREEDY-1"),
    "top_k": ("SAMPLE-TOPK-1", "SAMPLE-TOPK-2"),
    "top_p": ("SAMPLE-TOPP-1", "SAMPLE-TOPP-2"),
    "min_p": ("SAMPLE-MINP-1",),
    "repetition_penalty": ("LOGITS-REP-1",),
    "frequency_penalty": ("LOGITS-FREQ-1",),
    "presence_penalty": ("LOGITS-PRES-1",),
    "logit_bias": ("LOGITS-BIAS-1",),
    "min_tokens": ("LOGITS-MINTOK-1",),
}


@st.composite
def requests(draw: st.DrawFn, vocab: int, names: list[str]) -> tuple:
    """(params, prompt, output) with the named parameters set, the others at their defaults."""
    ids = token_ids(vocab)
    fields = {name: draw(parameter_values(name, vocab)) for name in names}
    if "min_tokens" in names:  # what min_tokens holds back
        fields["stop_token_ids"] = draw(st.lists(ids, max_size=2))
        fields["ignore_eos"] = draw(st.booleans())
    seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])))
    prompt = draw(st.lists(ids, min_size=1, max_size=6))
    output = draw(st.lists(ids, max_size=8))
    return SamplingParams(seed=seed, **fields), prompt, output


def check_batch(logits: list[list[float]], batch: list[tuple], eos: tuple[int, ...]) -> None:
    """Both real paths against the oracle, row by row; invalid rows must be reported."""
    if currently_in_test_context():
        for request in batch:
            note(f"{request[0]}, prompt {request[1]}, output {request[2]}")
    z = torch.tensor(logits, dtype=torch.float64)
    wants: list[oracle.Row | None] = []
    for request, row in zip(batch, logits, strict=True):
        try:
            wants.append(oracle_row(request, row, eos))
        except oracle.OracleInvalidRow:
            wants.append(None)
    invalid = [i for i, w in enumerate(wants) if w is None]
    processed, reasons = engine_rows(batch, z, eos)
    assert [i for i, r in enumerate(reasons) if r is not None] == invalid
    tensors = spec_tensors(batch, z.shape[1], eos)
    if invalid:
        with pytest.raises(InvalidLogitsError) as error:
            process_logits(z, **tensors.process_logits_args)
        assert error.value.rows == invalid
    else:
        spec = process_logits(z, **tensors.process_logits_args)
    for i, want in enumerate(wants):
        if want is not None:
            if not invalid:
                assert_row(spec[i], want, f"spec path, row {i}")
            assert_row(processed[i], want, f"engine path, row {i}")
    if invalid:
        return
    tokens = sample(z, **tensors).tolist()
    for i, (request, row) in enumerate(zip(batch, logits, strict=True)):
        params, prompt, output = request
        if wants[i].near:  # a token within rounding of a filter's threshold
            continue
        chosen = oracle.choose(params, row, prompt=prompt, output=output, eos_token_ids=eos)
        assert tokens[i] == chosen, f"row {i}: sample chose {tokens[i]}, the oracle {chosen}"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.clause(*c)) for n, c in PARAMETERS.items()]
)
@settings(max_examples=15)
@given(data=st.data())
def test_each_parameter_on_its_own_matches_the_oracle(name, data):
    vocab = data.draw(VOCAB, label="vocab")
    logits = data.draw(logits_rows(vocab), label="logits")
    eos = (data.draw(token_ids(vocab), label="eos"),)
    check_batch([logits], [data.draw(requests(vocab, [name]))], eos)


@pytest.mark.clause(
    "LOGITS-ORDER-1",
    "SAMPLE-ORDER-1",
    "SAMPLE-CHOICE-1",
    "SAMPLE-RNG-2",
    "SAMPLE-VALID-1",
    *{c for clauses in PARAMETERS.values() for c in clauses},
)
@settings(max_examples=30)
@given(data=st.data())
def test_a_batch_with_any_parameters_matches_the_oracle_row_by_row(data):
    vocab = data.draw(VOCAB, label="vocab")
    size = data.draw(st.integers(1, 4), label="batch")
    logits = [data.draw(logits_rows(vocab), label=f"logits {i}") for i in range(size)]
    eos = (data.draw(token_ids(vocab), label="eos"),)
    batch = []
    for _ in range(size):
        names = data.draw(st.lists(st.sampled_from(list(PARAMETERS)), unique=True))
        batch.append(data.draw(requests(vocab, names)))
    check_batch(logits, batch, eos)


# ---------------------------------------------------------------------------
# The spec's loop against the oracle, step by step

TOKENIZER = ByteTokenizer()
EOS = TOKENIZER.eos_token_ids
WEIGHTS = random_weights(small_config(max_context=40), seed=1, dtype=torch.float64)
PROMPT = list(b"abcab")

LOOP_PARAMS = {
    "repetition": SamplingParams(temperature=0.0, repetition_penalty=3.0, max_tokens=8),
    # plain greedy never repeats a token here: negative penalties make it repeat
    "frequency": SamplingParams(temperature=0.0, frequency_penalty=-1.5, max_tokens=8),
    "presence": SamplingParams(temperature=0.0, presence_penalty=-2.0, max_tokens=8),
    "bias": SamplingParams(temperature=0.0, logit_bias={ord("z"): 30.0}, max_tokens=4),
    # EOS is everyone's favourite, and min_tokens holds it back for 5 steps
    "min_tokens": SamplingParams(
        temperature=0.0, logit_bias={EOS[0]: 100.0}, min_tokens=5, max_tokens=8
    ),
    "sampled": SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=2**63 + 7, max_tokens=8
    ),
    "sampled-penalised": SamplingParams(
        temperature=1.5, presence_penalty=-1.0, frequency_penalty=0.5, seed=11, max_tokens=8
    ),
}


@pytest.mark.clause(
    "LOOP-SAMPLE-1",
    "LOGITS-BIAS-1",
    "LOGITS-MINTOK-1",
    "LOGITS-REP-1",
    "LOGITS-FREQ-1",
    "LOGITS-PRES-1",
    "SAMPLE-ORDER-1",
    "SAMPLE-CHOICE-1",
)
@pytest.mark.parametrize("name", list(LOOP_PARAMS))
def test_the_spec_loop_emits_the_oracles_tokens(name):
    params = LOOP_PARAMS[name]
    steps = list(
        generate(WEIGHTS, PROMPT, params, eos_token_ids=EOS, token_bytes=TOKENIZER.token_bytes)
    )
    tokens = [s.token_id for s in steps]
    for t, token in enumerate(tokens):
        logits = forward_naive(WEIGHTS, torch.tensor(PROMPT + tokens[:t]), last_only=True)[0]
        chosen = oracle.choose(
            params, logits.tolist(), prompt=PROMPT, output=tokens[:t], eos_token_ids=EOS
        )
        assert token == chosen, f"{name}: step {t} emitted {token}, the oracle chose {chosen}"
    if name == "min_tokens":  # held back for 5 steps, then chosen at once
        assert EOS[0] not in tokens[:5] and tokens[5:] == [EOS[0]], tokens


# ---------------------------------------------------------------------------
# The oracle's generator


@pytest.mark.clause("SAMPLE-RNG-1", "SAMPLE-RNG-2")
def test_oracle_philox_is_the_random123_generator_and_the_specs():
    # Random123's known answers for Philox4x32-10
    assert oracle.philox4x32_10((0, 0, 0, 0), (0, 0)) == (
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    )
    ones = 0xFFFFFFFF
    assert oracle.philox4x32_10((ones,) * 4, (ones, ones)) == (
        0x408F276D,
        0x41C83B0E,
        0xA20BC7C6,
        0x6D5451FD,
    )
    counter = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    key = (0xA4093822, 0x299F31D0)
    assert oracle.philox4x32_10(counter, key) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    words = philox4x32(
        tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key)
    )
    assert oracle.philox4x32_10(counter, key) == tuple(int(w) for w in words)
    for seed, step in [(0, 0), (12345, 3), (2**63 + 5, 2**32 + 1), (2**64 - 1, 7)]:
        bits = torch.tensor([seed - 2**64 if seed >= 2**63 else seed])
        spec = spec_uniform(bits, torch.tensor([step]), 37, dtype=torch.float64)[0].tolist()
        assert oracle.uniform(seed, step, 37) == spec, (seed, step)


# ---------------------------------------------------------------------------
# The oracle against a peer: Hugging Face transformers' processors


def _tie_free_rows(count: int, vocab: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(count, vocab, generator=g, dtype=torch.float64) * 3).tolist()


def _kept(values) -> list[bool]:
    return [v > -INF for v in values]


def _between(sorted_values: list[float]) -> list[float]:
    """Midpoints of consecutive distinct values: thresholds far from every statistic."""
    return [(a + b) / 2 for a, b in itertools.pairwise(sorted_values)]


def _filtered(row: list[float], **fields: float) -> oracle.Row:
    """The oracle's processed row with only the given filter parameters set."""
    return oracle.processed(SamplingParams(seed=1, **fields), row, prompt=[0], output=[])


@pytest.mark.clause(
    "LOGITS-BIAS-1",
    "LOGITS-MINTOK-1",
    "LOGITS-REP-1",
    "SOFTMAX-TEMP-1",
    "SAMPLE-TOPK-1",
    "SAMPLE-TOPP-1",
    "SAMPLE-MINP-1",
)
def test_oracle_agrees_with_the_transformers_processors():
    hf = pytest.importorskip("transformers.generation.logits_process")
    vocab = 9
    prompt, output = [1, 4, 4], [2, 7, 2, 2]
    ids = torch.tensor([prompt + output])
    for row in _tie_free_rows(6, vocab):
        scores = torch.tensor([row], dtype=torch.float64)

        for theta in (0.5, 1.25, 3.0):
            theirs = hf.RepetitionPenaltyLogitsProcessor(theta)(ids, scores.clone())[0]
            z = oracle.apply_processors(
                SamplingParams(repetition_penalty=theta), row, prompt=prompt, output=output
            )
            assert_values(theirs.tolist(), z, f"repetition {theta}")
        bias = {3: 2.5, 0: -7.25}
        sequence_bias = [[[i], b] for i, b in bias.items()]
        theirs = hf.SequenceBiasLogitsProcessor(sequence_bias)(ids, scores.clone())[0]
        z = oracle.apply_processors(
            SamplingParams(logit_bias=bias), row, prompt=prompt, output=output
        )
        assert_values(theirs.tolist(), z, "logit bias")
        for minimum in (len(output), len(output) + 1):
            new = hf.MinNewTokensLengthLogitsProcessor(len(prompt), minimum, [8, 5])
            fields = {"min_tokens": minimum, "stop_token_ids": [5]}
            z = oracle.apply_processors(
                SamplingParams(**fields), row, prompt=prompt, output=output, eos_token_ids=(8,)
            )
            assert_values(new(ids, scores.clone())[0].tolist(), z, f"min_tokens {minimum}")
        for t in (0.25, 0.75, 2.0):
            theirs = hf.TemperatureLogitsWarper(t)(ids, scores.clone())[0]
            top = float(theirs.max())
            assert_values(
                [x - top for x in theirs.tolist()], _filtered(row, temperature=t).values, f"T {t}"
            )
        for k in (1, 3, 8):
            theirs = hf.TopKLogitsWarper(k)(ids, scores.clone())[0]
            assert _kept(theirs.tolist()) == _kept(_filtered(row, top_k=k).values), f"top-k {k}"
        probs = torch.softmax(scores[0], dim=-1).sort(descending=True).values
        for p in _between(probs.cumsum(0).tolist()):
            p = oracle.float32(p)
            theirs = hf.TopPLogitsWarper(p)(ids, scores.clone())[0]
            assert _kept(theirs.tolist()) == _kept(_filtered(row, top_p=p).values), f"top-p {p}"
        ratios = (probs / probs[0]).tolist()
        for m in _between(ratios):
            m = oracle.float32(m)
            theirs = hf.MinPLogitsWarper(m)(ids, scores.clone())[0]
            assert _kept(theirs.tolist()) == _kept(_filtered(row, min_p=m).values), f"min-p {m}"
