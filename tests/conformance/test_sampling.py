"""Conformance: the sampling stage (filters, greedy, random numbers, sample, logprobs).

Discrete outputs are compared with the definitions evaluated in float64;
tokens whose deciding statistic lies within rounding of a threshold are
computed explicitly (tests/oracle.py) instead of loosening every comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from scipy import stats

from decodespec.spec import registry
from decodespec.spec.logits import apply_logit_processors
from decodespec.spec.sampling import process_logits
from decodespec.spec.softmax import apply_temperature
from tests import oracle
from tests.strategies import (
    DEVICE,
    LARGE,
    logits,
    min_ps,
    per_row,
    sampling_args,
    top_ks,
    top_ps,
)

REL = 2.0**-21  # a few float32 ulps, relative: rounding of scaled logits and probabilities


def mass_margin(vocab: int) -> float:
    """Bound on the float32 error of a sum of at most `vocab` probabilities."""
    return registry.OPERATIONS["top_p_mask"].tolerance.margin * (vocab + 16)


def shuffled(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(x.shape[-1], generator=g).to(x.device)
    return x[:, perm], perm


# ---------------------------------------------------------------- greedy


@pytest.mark.clause("SAMPLE-GREEDY-1")
@given(x=logits())
def test_greedy_matches_reference(impl, x):
    out = impl.op("greedy")(x)
    ref = registry.OPERATIONS["greedy"].reference(x.double())
    assert torch.equal(out.cpu(), ref.cpu())


@pytest.mark.clause("SAMPLE-GREEDY-1")
@given(vocab=st.integers(2, 64), first=st.integers(0, 63), second=st.integers(0, 63))
def test_greedy_ties_go_to_the_smallest_index(impl, vocab, first, second):
    first, second = first % vocab, second % vocab
    x = torch.zeros(1, vocab, device=DEVICE)
    x[0, first] = x[0, second] = 5.0
    assert impl.op("greedy")(x).item() == min(first, second)


# ---------------------------------------------------------------- top-k


@pytest.mark.clause("SAMPLE-TOPK-1", "SAMPLE-TOPK-2")
@given(x=logits(), data=st.data())
def test_top_k_matches_definition(impl, x, data):
    k = per_row(data.draw, x.shape[0], top_ks(x.shape[1]), torch.int64)
    mask = impl.op("top_k_mask")(x, k)
    exact = oracle.top_k(x, k, rel=0.0)  # comparisons of the same values: no rounding
    assert torch.equal(exact.strict, exact.loose)
    assert torch.equal(mask.cpu(), exact.strict.cpu())


@pytest.mark.clause("SAMPLE-TOPK-2")
def test_top_k_keeps_every_token_tied_at_the_boundary(impl):
    x = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]], device=DEVICE)
    mask = impl.op("top_k_mask")(x, torch.tensor([2], device=DEVICE))
    assert mask.cpu().tolist() == [[True, True, True, True, False]]


@pytest.mark.clause("SAMPLE-TOPK-1")
def test_top_k_never_keeps_masked_tokens(impl):
    x = torch.tensor([[1.0, -math.inf, -math.inf]], device=DEVICE)
    for k in (0, 3, 10):
        mask = impl.op("top_k_mask")(x, torch.tensor([k], device=DEVICE))
        assert mask.cpu().tolist() == [[True, False, False]], k


# ---------------------------------------------------------------- top-p


@pytest.mark.clause("SAMPLE-TOPP-1", "SAMPLE-TOPP-2")
@given(x=logits(), data=st.data())
def test_top_p_matches_definition(impl, x, data):
    p = per_row(data.draw, x.shape[0], top_ps(), torch.float32)
    mask = impl.op("top_p_mask")(x, p)
    finite = x > -math.inf
    kept = oracle.top_p(x, finite, p, REL, mass_margin(x.shape[1]))
    oracle.assert_between(mask, kept, "top_p_mask")


@pytest.mark.clause("SAMPLE-TOPP-2")
def test_top_p_keeps_the_crossing_token(impl):
    # probabilities 0.5, 0.3, 0.2: with p = 0.6 the second token crosses 0.6 and is kept.
    x = torch.tensor([[0.5, 0.3, 0.2]], device=DEVICE).log()
    mask = impl.op("top_p_mask")(x, torch.tensor([0.6], device=DEVICE))
    assert mask.cpu().tolist() == [[True, True, False]]


@pytest.mark.clause("SAMPLE-TOPP-2")
@pytest.mark.parametrize(
    ("p", "expected"), [(0.3, [True, False, False, False]), (0.5, [True, True, True, False])]
)
def test_top_p_keeps_or_drops_tied_tokens_together(impl, p, expected):
    # probabilities 0.4, 0.25, 0.25, 0.1: the tied pair has 0.4 above it.
    x = torch.tensor([[0.4, 0.25, 0.25, 0.1]], device=DEVICE).log()
    mask = impl.op("top_p_mask")(x, torch.tensor([p], device=DEVICE))
    assert mask.cpu().tolist() == [expected]


@pytest.mark.clause("SAMPLE-TOPP-1")
def test_top_p_one_disables_the_filter(impl):
    # Many tiny tokens: rounding of the running sum must not drop the smallest at p = 1.
    x = torch.cat([torch.tensor([[30.0]]), torch.zeros(1, 4000)], dim=1).to(DEVICE)
    mask = impl.op("top_p_mask")(x, torch.tensor([1.0], device=DEVICE))
    assert bool(mask.all())


# ---------------------------------------------------------------- min-p


@pytest.mark.clause("SAMPLE-MINP-1")
@given(x=logits(), data=st.data())
def test_min_p_matches_definition(impl, x, data):
    m = per_row(data.draw, x.shape[0], min_ps(), torch.float32)
    mask = impl.op("min_p_mask")(x, m)
    kept = oracle.min_p(x, x > -math.inf, m, REL)
    oracle.assert_between(mask, kept, "min_p_mask")


@pytest.mark.clause("SAMPLE-MINP-1")
@given(x=logits(dtypes=(torch.float32,), masked=False), data=st.data())
def test_min_p_logit_form_equals_probability_form(impl, x, data):
    m = per_row(data.draw, x.shape[0], min_ps(), torch.float32)
    mask = impl.op("min_p_mask")(x, m).cpu()
    probs = torch.softmax(x.double(), dim=-1).cpu()
    ratio = probs / probs.amax(-1, keepdim=True)
    m64 = m.double().cpu()[:, None]
    clear = (ratio - m64).abs() > 1e-5 * m64.clamp(min=1e-30) + 1e-300
    note(f"ratio={ratio.tolist()} m={m.tolist()}")
    assert torch.equal(mask[clear], (ratio >= m64)[clear])


# ---------------------------------------------------------------- all filters


@pytest.mark.clause("SAMPLE-ORDER-1", "SAMPLE-TOPK-1", "SAMPLE-TOPP-1", "SAMPLE-MINP-1")
@given(x=logits(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_masks_are_permutation_equivariant(impl, x, data, seed):
    batch, vocab = x.shape
    args = {
        "top_k_mask": per_row(data.draw, batch, top_ks(vocab), torch.int64),
        "top_p_mask": per_row(data.draw, batch, top_ps(), torch.float32),
        "min_p_mask": per_row(data.draw, batch, min_ps(), torch.float32),
    }
    y, perm = shuffled(x, seed)
    for name, param in args.items():
        mask = impl.op(name)(x, param)
        permuted = impl.op(name)(y, param)
        # Only tokens decided beyond rounding must agree; top-k compares values exactly.
        if name == "top_p_mask":
            kept = oracle.top_p(y, y > -math.inf, param, REL, mass_margin(vocab))
            settled = kept.strict == kept.loose
        elif name == "min_p_mask":
            kept = oracle.min_p(y, y > -math.inf, param, REL)
            settled = kept.strict == kept.loose
        else:
            settled = torch.ones_like(mask, dtype=torch.bool)
        assert torch.equal(mask[:, perm][settled], permuted[settled]), name


@pytest.mark.clause("SAMPLE-ORDER-1")
@given(x=logits(), data=st.data())
def test_every_filter_keeps_every_maximum(impl, x, data):
    batch, vocab = x.shape
    is_max = x == x.amax(-1, keepdim=True)
    for name, values in (
        ("top_k_mask", top_ks(vocab)),
        ("top_p_mask", top_ps()),
        ("min_p_mask", min_ps()),
    ):
        dtype = torch.int64 if name == "top_k_mask" else torch.float32
        mask = impl.op(name)(x, per_row(data.draw, batch, values, dtype))
        assert bool(mask[is_max].all()), name
        assert bool(mask.any(-1).all()), name


# ---------------------------------------------------------------- random numbers


@pytest.mark.clause("SAMPLE-RNG-1", "SAMPLE-RNG-2")
@given(
    seeds=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=4),
    step=st.integers(0, 2**63 - 1),
    vocab=st.integers(1, 300),
)
def test_uniform_is_bit_identical(impl, seeds, step, vocab):
    seed = torch.tensor(seeds, dtype=torch.int64, device=DEVICE)
    steps = torch.full_like(seed, step)
    out = impl.op("uniform")(seed, steps, vocab)
    ref = registry.OPERATIONS["uniform"].reference(seed.cpu(), steps.cpu(), vocab)
    assert out.dtype == torch.float32
    assert torch.equal(out.cpu(), ref)
    assert bool(((out > 0) & (out < 1)).all())
    # U = (2k + 1) / 2^24 with k < 2^23
    k = (out.double().cpu() * 2**24 - 1) / 2
    assert torch.equal(k, k.floor())


@pytest.mark.clause("SAMPLE-RNG-3")
@given(
    seeds=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=2, max_size=6),
    steps=st.lists(st.integers(0, 2**40), min_size=6, max_size=6),
    vocab=st.integers(1, 100),
    seed=st.integers(0, 2**32 - 1),
)
def test_uniform_depends_only_on_seed_step_and_index(impl, seeds, steps, vocab, seed):
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=DEVICE)
    step_t = torch.tensor(steps[: len(seeds)], dtype=torch.int64, device=DEVICE)
    whole = impl.op("uniform")(seed_t, step_t, vocab)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(seeds), generator=g).to(DEVICE)
    permuted = impl.op("uniform")(seed_t[order], step_t[order], vocab)
    assert torch.equal(permuted, whole[order])
    alone = impl.op("uniform")(seed_t[:1], step_t[:1], vocab)
    assert torch.equal(alone[0], whole[0])


# ---------------------------------------------------------------- sample


def processor_args(args: dict) -> dict:
    """The arguments of `sample` that belong to the logit processors."""
    return {
        k: v for k, v in args.items() if k not in ("temperature", "top_k", "top_p", "min_p", "seed")
    }


def reference_kept(x: torch.Tensor, args: dict) -> tuple[torch.Tensor, oracle.Kept]:
    """Scaled processed logits (float64) and the strict / loose kept sets of each row."""
    processed = apply_logit_processors(x.double(), **processor_args(args))
    scaled = apply_temperature(processed, args["temperature"])
    kept = oracle.chain(
        scaled,
        args["top_k"],
        args["top_p"],
        args["min_p"],
        rel=REL,
        mass_margin=mass_margin(x.shape[1]),
    )
    return scaled, kept


def assert_tokens_conform(x: torch.Tensor, args: dict, tokens: torch.Tensor) -> None:
    """Tokens equal the spec's, except where rounding makes the choice ambiguous."""
    ref = registry.OPERATIONS["sample"].reference(x.double(), **args)
    tokens, ref = tokens.cpu(), ref.cpu()
    if torch.equal(tokens, ref):
        return
    scaled, kept = reference_kept(x, args)
    noise = registry.OPERATIONS["uniform"].reference(
        args["seed"].cpu(), args["step"].cpu(), x.shape[1], dtype=torch.float64
    )
    gumbel = -(-noise.log()).log()
    margin = registry.OPERATIONS["sample"].tolerance.margin
    for row in (tokens != ref).nonzero().flatten().tolist():
        t = tokens[row].item()
        if args["temperature"][row].item() == 0:
            z = apply_logit_processors(x.double(), **processor_args(args))[row].cpu()
            assert z[t] >= z.max() - margin * max(1.0, z.max().abs().item()), (row, t, ref[row])
            continue
        score = scaled[row].cpu() + gumbel[row]
        assert kept.loose[row, t], (
            f"row {row}: token {t} is not kept by the definition (spec: {ref[row].item()})"
        )
        best = score.masked_fill(~kept.strict[row].cpu(), -math.inf).max()
        tol = margin * max(1.0, best.abs().item())
        assert score[t] >= best - tol, (
            f"row {row}: token {t} scores {score[t]:.9g}, best {best:.9g}"
        )


@pytest.mark.clause("SAMPLE-ORDER-1", "SAMPLE-CHOICE-1", "SAMPLE-GREEDY-1")
@given(x=logits(), data=st.data())
def test_sample_matches_reference(impl, x, data):
    args = data.draw(sampling_args(*x.shape))
    tokens = impl.op("sample")(x, **args)
    assert tokens.dtype == torch.int64 and tokens.shape == (x.shape[0],)
    assert_tokens_conform(x, args, tokens)


def add_processor_args(impl, data, args: dict, batch: int, vocab: int) -> None:
    """Draw some of the logit processors into `args` (each skips the test if unsupported)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans()):
        impl.require("logit_bias")
        args["logit_bias"] = (
            (torch.rand(batch, vocab, generator=g) * 20 - 10)
            * (torch.rand(batch, vocab, generator=g) < 0.2)
        ).to(DEVICE)
    if data.draw(st.booleans()):
        impl.require("min_tokens")
        args["stop_token_mask"] = (torch.rand(batch, vocab, generator=g) < 0.1).to(DEVICE)
        args["min_tokens"] = per_row(data.draw, batch, st.integers(0, 3), torch.int64)
        args["step"] = per_row(data.draw, batch, st.integers(0, 4), torch.int64)
    if data.draw(st.booleans()):
        impl.require("penalties")
        args["prompt_mask"] = (torch.rand(batch, vocab, generator=g) < 0.3).to(DEVICE)
        args["output_counts"] = (
            torch.randint(0, 3, (batch, vocab), generator=g).to(torch.int32).to(DEVICE)
        )
        args["repetition_penalty"] = per_row(data.draw, batch, st.floats(0.5, 2.0), torch.float32)
        args["frequency_penalty"] = per_row(data.draw, batch, st.floats(-2, 2), torch.float32)
        args["presence_penalty"] = per_row(data.draw, batch, st.floats(-2, 2), torch.float32)


def assert_rows_banned_entirely(x: torch.Tensor, args: dict, error: ValueError) -> None:
    """The error names exactly the rows whose processed logits are all −inf."""
    assert_invalid_logits_error(error)
    processed = apply_logit_processors(x.double(), **processor_args(args))
    assert error.rows == (processed == -math.inf).all(-1).nonzero().flatten().tolist()


@pytest.mark.clause(
    "LOGITS-ORDER-1",
    "LOGITS-BIAS-1",
    "LOGITS-MINTOK-1",
    "LOGITS-REP-1",
    "LOGITS-FREQ-1",
    "LOGITS-PRES-1",
)
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_sample_with_processors_matches_reference(impl, x, data):
    args = data.draw(sampling_args(*x.shape))
    add_processor_args(impl, data, args, *x.shape)
    try:
        tokens = impl.op("sample")(x, **args)
    except ValueError as error:  # min_tokens may ban every finite token of a row
        assert_rows_banned_entirely(x, args, error)
        return
    assert_tokens_conform(x, args, tokens)


@pytest.mark.clause("LOGITS-ORDER-1")
def test_processor_order_decides_the_token(impl):
    # bias first, then repetition: token 0 goes 1 → 2 → 2/4 = 0.5 and token 1 (0.6) wins.
    # (repetition first would give 1/4 + 1 = 1.25 and token 0 would win.)
    x = torch.tensor([[1.0, 0.6]], device=DEVICE)
    tokens = impl.op("sample")(
        x,
        temperature=torch.zeros(1, device=DEVICE),
        logit_bias=torch.tensor([[1.0, 0.0]], device=DEVICE),
        prompt_mask=torch.tensor([[True, False]], device=DEVICE),
        output_counts=torch.zeros(1, 2, dtype=torch.int32, device=DEVICE),
        repetition_penalty=torch.tensor([4.0], device=DEVICE),
        frequency_penalty=torch.zeros(1, device=DEVICE),
        presence_penalty=torch.zeros(1, device=DEVICE),
    )
    assert tokens.tolist() == [1]


@pytest.mark.clause("SAMPLE-GREEDY-1", "SOFTMAX-TEMP-1")
@pytest.mark.parametrize("temperature", [1e-3, 1e-8, 1e-20, 1e-38, 1e-45])
def test_tiny_temperature_tends_to_greedy(impl, temperature):
    x = torch.tensor([[1.0, 4.0, 3.999, 4.0, -2.0]] * 8, device=DEVICE)
    tokens = impl.op("sample")(
        x,
        temperature=torch.full((8,), temperature, device=DEVICE),
        seed=torch.arange(8, device=DEVICE),
    )
    if temperature <= 1e-8:
        assert set(tokens.tolist()) <= {1, 3}, tokens  # only the tied maxima remain
    else:
        assert set(tokens.tolist()) <= {1, 2, 3}


@pytest.mark.clause("SAMPLE-RNG-3", "SAMPLE-CHOICE-1")
@given(x=logits(), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_sample_is_batch_invariant(impl, x, data, seed):
    args = data.draw(sampling_args(*x.shape))
    whole = impl.op("sample")(x, **args)
    g = torch.Generator().manual_seed(seed)
    batch = x.shape[0]
    # Any subset of rows, in any order, with repeats: each row's token is unchanged.
    rows = torch.randint(batch, (data.draw(st.integers(1, 2 * batch)),), generator=g).to(DEVICE)
    part = impl.op("sample")(x[rows], **{k: v[rows] for k, v in args.items()})
    assert torch.equal(part, whole[rows])
    again = impl.op("sample")(x, **args)
    assert torch.equal(again, whole), "sampling must be deterministic"


@pytest.mark.clause(
    "SAMPLE-CHOICE-1", "SAMPLE-ORDER-1", "SAMPLE-TOPP-1", "SAMPLE-TOPK-1", "SAMPLE-MINP-1"
)
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 5, 0.9, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.08),
        (0.9, 6, 0.95, 0.05),
    ],
)
def test_sampled_frequencies_match_the_filtered_distribution(
    impl, temperature, top_k, top_p, min_p
):
    """Chi-square goodness of fit at a fixed seed; false-positive rate 1e-3 per case.

    One row per step of the same request, so every draw uses fresh counters
    of the generator: 20,000 draws on a GPU, 500 where kernels run in the
    Triton interpreter (about 50 ms a row there). The 500 still catch a
    filtered token drawn at all, and gross departures from the distribution.
    """
    draws, vocab = (20_000 if LARGE else 500), 12
    x = torch.linspace(0, 3, vocab).flip(0)[None, :].repeat(draws, 1).to(DEVICE)
    x = x + torch.tensor([0.0, 0.1] * (vocab // 2), device=DEVICE)  # no ties
    args = {
        "temperature": torch.full((draws,), temperature, device=DEVICE),
        "top_k": torch.full((draws,), top_k, dtype=torch.int64, device=DEVICE),
        "top_p": torch.full((draws,), top_p, device=DEVICE),
        "min_p": torch.full((draws,), min_p, device=DEVICE),
        "seed": torch.full((draws,), 20261121, dtype=torch.int64, device=DEVICE),
        "step": torch.arange(draws, device=DEVICE),
    }
    tokens = impl.op("sample")(x, **args).cpu()
    probs = torch.softmax(
        process_logits(x[:1].double(), **{k: v[:1] for k, v in args.items() if k != "seed"}), -1
    )[0].cpu()
    counts = torch.bincount(tokens, minlength=vocab).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0, (
        f"sampled filtered tokens: {counts.tolist()} probs {probs.tolist()}"
    )
    result = stats.chisquare(counts[kept].numpy(), (probs[kept] * draws).numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), (probs * draws).tolist(), result)


# ---------------------------------------------------------------- validity


def assert_invalid_logits_error(error: ValueError) -> None:
    """SAMPLE-VALID-2: an `InvalidLogitsError`, a ValueError with `.rows` and `.tokens`.

    Each implementation defines the class (kernels cannot import the spec's),
    so the name and the attributes are the contract, not the spec's class.
    """
    assert type(error).__name__ == "InvalidLogitsError", repr(error)
    assert isinstance(error.rows, list) and isinstance(error.tokens, torch.Tensor)


@pytest.mark.clause("SAMPLE-VALID-1", "SAMPLE-VALID-2")
@pytest.mark.parametrize("poison", ["nan", "+inf", "all -inf"])
@given(x=logits(max_batch=4), data=st.data())
def test_invalid_rows_are_reported_and_others_sampled(impl, poison, x, data):
    batch = x.shape[0]
    bad_rows = sorted(
        set(data.draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch)))
    )
    y = x.clone()
    for row in bad_rows:
        if poison == "nan":
            y[row, data.draw(st.integers(0, x.shape[1] - 1))] = math.nan
        elif poison == "+inf":
            y[row, data.draw(st.integers(0, x.shape[1] - 1))] = math.inf
        else:
            y[row] = -math.inf
    args = data.draw(sampling_args(*x.shape))
    with pytest.raises(ValueError) as error:
        impl.op("sample")(y, **args)
    assert_invalid_logits_error(error.value)
    assert error.value.rows == bad_rows
    assert str(bad_rows) in str(error.value)
    tokens = error.value.tokens.cpu()
    assert all(tokens[r] == -1 for r in bad_rows)
    good = [r for r in range(batch) if r not in bad_rows]
    if good:
        expected = impl.op("sample")(x[good], **{k: v[good] for k, v in args.items()})
        assert torch.equal(tokens[good], expected.cpu())


@pytest.mark.clause("SAMPLE-VALID-1")
def test_processors_that_break_a_row_make_it_invalid(impl):
    # A tiny repetition penalty overflows 1e30 / 1e-30 to +inf.
    x = torch.tensor([[1e30, 0.0], [1.0, 0.0]], device=DEVICE)
    with pytest.raises(ValueError) as error:
        impl.op("sample")(
            x,
            temperature=torch.zeros(2, device=DEVICE),
            prompt_mask=torch.tensor([[True, False], [True, False]], device=DEVICE),
            output_counts=torch.zeros(2, 2, dtype=torch.int32, device=DEVICE),
            repetition_penalty=torch.tensor([1e-30, 1e-30], device=DEVICE),
            frequency_penalty=torch.zeros(2, device=DEVICE),
            presence_penalty=torch.zeros(2, device=DEVICE),
        )
    assert_invalid_logits_error(error.value)
    assert error.value.rows == [0]
    assert error.value.tokens.tolist() == [-1, 0]


# ---------------------------------------------------------------- parameters


BAD_PARAMETERS = [
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_k", -1),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("step", -1),
]


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(("name", "value"), BAD_PARAMETERS)
def test_sample_rejects_out_of_range_parameters(impl, name, value):
    x = torch.zeros(2, 5, device=DEVICE)
    args = {
        "temperature": torch.ones(2, device=DEVICE),
        "top_k": torch.zeros(2, dtype=torch.int64, device=DEVICE),
        "top_p": torch.ones(2, device=DEVICE),
        "min_p": torch.zeros(2, device=DEVICE),
        "seed": torch.zeros(2, dtype=torch.int64, device=DEVICE),
        "step": torch.zeros(2, dtype=torch.int64, device=DEVICE),
    }
    args[name] = args[name].clone()
    args[name][1] = value
    with pytest.raises(ValueError, match=name):
        impl.op("sample")(x, **args)


@pytest.mark.clause("PARAM-RANGE-1")
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("logit_bias", 101.0),
    ],
)
def test_sample_rejects_out_of_range_processor_parameters(impl, name, value):
    x = torch.zeros(1, 4, device=DEVICE)
    args = {
        "prompt_mask": torch.zeros(1, 4, dtype=torch.bool, device=DEVICE),
        "output_counts": torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
        "repetition_penalty": torch.ones(1, device=DEVICE),
        "frequency_penalty": torch.zeros(1, device=DEVICE),
        "presence_penalty": torch.zeros(1, device=DEVICE),
        "logit_bias": torch.zeros(1, 4, device=DEVICE),
    }
    args[name] = torch.full_like(args[name], value)
    with pytest.raises(ValueError, match=name):
        impl.op("sample")(x, temperature=torch.zeros(1, device=DEVICE), **args)


@pytest.mark.clause("PARAM-RANGE-1")
def test_sample_rejects_bad_shapes_and_missing_seed(impl):
    x = torch.zeros(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="temperature"):
        impl.op("sample")(
            x,
            temperature=torch.ones(3, device=DEVICE),
            seed=torch.zeros(3, dtype=torch.int64, device=DEVICE),
        )
    with pytest.raises(ValueError, match="seed"):
        impl.op("sample")(x, temperature=torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="logits"):
        impl.op("sample")(torch.zeros(5, device=DEVICE), temperature=torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="top_k"):
        impl.op("sample")(
            x, temperature=torch.zeros(2, device=DEVICE), top_k=torch.ones(2, device=DEVICE)
        )


# ---------------------------------------------------------------- arguments

# The processor arguments of `sample` and `process_logits`: each comes with the
# others of its group, and the group with the optional feature it needs.
PROCESSOR_GROUPS = (
    (("token_bitmask",), "token_bitmask"),
    (("logit_bias",), "logit_bias"),
    (("stop_token_mask", "min_tokens"), "min_tokens"),
    (
        (
            "prompt_mask",
            "output_counts",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        ),
        "penalties",
    ),
)
SAMPLE_TENSORS = (
    "logits",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "step",
    *(name for group, _ in PROCESSOR_GROUPS for name in group),
)


def valid_sample_args(impl, name: str | None = None, batch: int = 2, vocab: int = 5) -> dict:
    """A valid call of `sample` (logits first): a greedy row and a filtered, seeded one,
    with the processor group of `name`, if it has one (skipping if it is unsupported)."""
    g = torch.Generator().manual_seed(batch * 1000 + vocab)

    def rows(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values[:batch], dtype=dtype, device=DEVICE)

    def per_token(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE)

    args = {
        "logits": per_token(torch.randn(batch, vocab, generator=g)),
        "temperature": rows([0.0, 0.8]),
        "top_k": rows([0, 3], torch.int64),
        "top_p": rows([1.0, 0.9]),
        "min_p": rows([0.0, 0.05]),
        "seed": rows([0, 12345], torch.int64),
        "step": rows([0, 4], torch.int64),
    }
    processors = {
        # Row 0 allows every token (a row without a grammar), row 1 every other token.
        "token_bitmask": per_token(
            torch.tensor([-1, 0x55555555], dtype=torch.int32)[:batch, None].expand(
                batch, max(1, (vocab + 31) // 32)
            )
        ),
        "logit_bias": per_token(torch.rand(batch, vocab, generator=g) * 4 - 2),
        "stop_token_mask": per_token(torch.rand(batch, vocab, generator=g) < 0.3),
        "min_tokens": rows([2, 0], torch.int64),
        "prompt_mask": per_token(torch.rand(batch, vocab, generator=g) < 0.5),
        "output_counts": per_token(torch.randint(0, 3, (batch, vocab), generator=g)),
        "repetition_penalty": rows([1.3, 1.0]),
        "frequency_penalty": rows([0.0, 0.0]),
        "presence_penalty": rows([0.0, 0.0]),
    }
    for group, feature in PROCESSOR_GROUPS:
        if name in group:
            impl.require(feature)
            args.update({k: processors[k] for k in group})
    return args


def not_a_tensor(t: torch.Tensor, kind: str) -> object:
    """What a caller passes by mistake instead of `t`: a Python number, or its values as
    a (nested) list."""
    return 1.5 if kind == "float" else t.tolist()


def call_with_logits_first(op, args: dict):
    """Call `op` with `logits` positional (the first parameter of every operation that
    takes it) and everything else by keyword."""
    args = dict(args)
    return op(args.pop("logits"), **args)


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize("name", SAMPLE_TENSORS)
def test_sample_names_an_argument_that_is_not_a_tensor(impl, name, kind):
    args = valid_sample_args(impl, name)
    args[name] = not_a_tensor(args[name], kind)
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        call_with_logits_first(impl.op("sample"), args)


@pytest.mark.clause("SAMPLE-VALID-3")
def test_sample_names_a_missing_temperature(impl):
    args = valid_sample_args(impl)
    args["temperature"] = None
    with pytest.raises(TypeError, match=r"\btemperature\b"):
        call_with_logits_first(impl.op("sample"), args)


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize("batch", [2, 0])
def test_sample_rejects_an_empty_vocabulary(impl, batch):
    args = valid_sample_args(impl, batch=batch, vocab=0)
    with pytest.raises(ValueError, match=r"\blogits\b"):
        call_with_logits_first(impl.op("sample"), args)


def valid_simple_args(op: str, batch: int = 2, vocab: int = 5) -> dict:
    """A valid call of the operations whose arguments are all positional, in order."""
    g = torch.Generator().manual_seed(batch * 1000 + vocab)
    x = torch.randn(batch, vocab, generator=g).to(DEVICE)

    def rows(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(values[:batch], dtype=dtype, device=DEVICE)

    return {
        "greedy": lambda: {"logits": x},
        "top_k_mask": lambda: {"logits": x, "top_k": rows([1, 3], torch.int64)},
        "top_p_mask": lambda: {"logits": x, "top_p": rows([0.5, 0.9])},
        "min_p_mask": lambda: {"logits": x, "min_p": rows([0.1, 0.5])},
        "compute_logprobs": lambda: {"logits": x, "token_ids": rows([0, vocab - 1], torch.int64)},
        "uniform": lambda: {
            "seed": rows([0, 7], torch.int64),
            "step": rows([3, 0], torch.int64),
            "vocab_size": vocab,
        },
    }[op]()


SIMPLE_TENSORS = [
    (op, name)
    for op in ("greedy", "top_k_mask", "top_p_mask", "min_p_mask", "compute_logprobs", "uniform")
    for name, value in valid_simple_args(op).items()
    if isinstance(value, torch.Tensor)
]


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize(("op", "name"), SIMPLE_TENSORS)
def test_operations_name_an_argument_that_is_not_a_tensor(impl, op, name, kind):
    args = valid_simple_args(op)
    args[name] = not_a_tensor(args[name], kind)
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op(op)(*args.values())


@pytest.mark.clause("SAMPLE-VALID-3")
@pytest.mark.parametrize(
    ("op", "batch"),
    [
        *(
            (op, batch)
            for op in ("greedy", "top_k_mask", "top_p_mask", "min_p_mask")
            for batch in (2, 0)
        ),
        ("compute_logprobs", 0),  # with rows, no token id could be inside the vocabulary
    ],
)
def test_operations_reject_an_empty_vocabulary(impl, op, batch):
    args = valid_simple_args(op, batch=batch, vocab=0)
    with pytest.raises(ValueError, match=r"\blogits\b"):
        impl.op(op)(*args.values())


# ---------------------------------------------------------------- logprobs


@pytest.mark.clause("LOGPROB-RAW-1", "LOGPROB-RANK-1", "LOGPROB-TOP-1")
@given(x=logits(), data=st.data())
def test_logprobs_match_reference(impl, x, data):
    batch, vocab = x.shape
    finite_rows = [torch.nonzero(torch.isfinite(x[r])).flatten().tolist() for r in range(batch)]
    token_ids = torch.tensor([data.draw(st.sampled_from(f)) for f in finite_rows], device=DEVICE)
    n = data.draw(st.integers(0, min(20, vocab)))
    out = impl.op("compute_logprobs")(x, token_ids, n)
    ref = registry.OPERATIONS["compute_logprobs"].reference(x.double(), token_ids, n)
    lp = torch.log_softmax(x.double(), -1).cpu()
    margin = registry.OPERATIONS["compute_logprobs"].tolerance.margin
    assert torch.allclose(
        out.token_logprobs.double().cpu(), ref.token_logprobs.cpu(), rtol=1e-5, atol=1e-5
    )
    # Ranks may differ only through tokens within rounding of the chosen one.
    chosen = ref.token_logprobs.cpu()[:, None]
    near = ((lp - chosen).abs() <= margin * chosen.abs().clamp(min=1)).sum(-1)
    assert bool(((out.ranks.cpu() - ref.ranks.cpu()).abs() < near).all())
    assert out.top_token_ids.shape == (batch, n)
    # Top lists agree except where neighbouring values are within rounding.
    got = lp.gather(-1, out.top_token_ids.cpu())
    want = ref.top_logprobs.cpu()
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert torch.allclose(out.top_logprobs.double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.clause("LOGPROB-RANK-1", "LOGPROB-TOP-1")
def test_logprob_ties_go_to_the_smaller_id(impl):
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0]], device=DEVICE)
    out = impl.op("compute_logprobs")(x, torch.tensor([4], device=DEVICE), 4)
    assert out.top_token_ids.cpu().tolist() == [[1, 3, 2, 4]]
    assert out.ranks.cpu().tolist() == [3]  # tied tokens share a rank


@pytest.mark.clause("LOGPROB-TOP-1")
@pytest.mark.parametrize("n", [-1, 21])
def test_logprobs_reject_out_of_range_top_n(impl, n):
    x = torch.zeros(1, 30, device=DEVICE)
    with pytest.raises(ValueError, match="num_top"):
        impl.op("compute_logprobs")(x, torch.tensor([0], device=DEVICE), n)
