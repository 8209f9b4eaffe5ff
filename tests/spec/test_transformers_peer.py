"""The spec against a peer: the Hugging Face transformers logits warpers.

`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`,
`MinPLogitsWarper` and `RepetitionPenaltyLogitsProcessor` implement the same
stages with different arithmetic:

- temperature: HF returns `z / T`, the spec `(z − max z) / T` (SOFTMAX-TEMP-1):
  equal up to a per-row shift, within float32 rounding;
- top-k: HF keeps `z >= (k-th largest value)`, the spec `#{z_j > z_i} < k`:
  the same set, ties included;
- top-p: HF sorts the logits ascending and removes a token when the cumulative
  probability up to and including it is `<= 1 − p`; the spec keeps a token
  when the mass strictly above it is `< p`. Equal in exact arithmetic on
  tie-free rows, so the rows are compared outside a band around the threshold;
- min-p: HF compares float32 probabilities `π_i < m · π_max`, the spec logits
  `z_i >= z_max + ln m`; compared outside a band around the threshold;
- repetition penalty: HF multiplies when `z < 0`, the spec divides when `z > 0`;
  both leave 0 at 0, so the values agree bit for bit.

Boundary band. A token whose boundary statistic, computed in float64 from the
float32 inputs, lies within `1e-5 + 2^-21 · M` of the threshold (`M`: the
largest magnitude among the row's scaled logits and `|ln m|`, so that the band
covers the float32 rounding of the logits themselves: 1e-5 to about 1e-4 for
the unscaled rows drawn here, wider for rows divided by a small temperature)
may legitimately be decided either way and is left out of the comparison.
Every other token must be decided the same way by the spec, by HF and by the
exact (float64) definition. The tests also draw parameters just outside the
band on purpose, so the comparison near the threshold is exercised, not only
far from it.

Ties. The rows are tie-free (rows with repeated logits are rejected). The
spec's top-p ties are ties of the float32 probabilities it computes, and two
distinct logits closer than about 1e-7 can round to the same probability; such
tokens form a tie group for the spec (kept together) but not for HF, so they
are left out of the top-p comparison and shown in a test of their own. The
fixed-input tests at the end show where the spec and HF differ by design.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from decodespec.spec.logits import apply_penalties
from decodespec.spec.sampling import min_p_mask, process_logits, top_k_mask, top_p_mask
from decodespec.spec.softmax import apply_temperature, softmax
from tests.repro import source

hf = pytest.importorskip("transformers.generation.logits_process")

MAX_BATCH = 4
MAX_VOCAB = 300
BAND = 1e-5  # the fixed part of the boundary band (module docstring)
BAND_PER_MAGNITUDE = 2.0**-21  # its float32-rounding part, per unit of logit magnitude
MIN_P_FLOOR = 1e-30  # m · π_max stays a normal float32, where HF's comparison is exact enough
NO_INPUT_IDS = torch.zeros((1, 1), dtype=torch.long)  # the warpers ignore input_ids


# ---------------------------------------------------------------------------
# Inputs


def _tie_free(x: torch.Tensor) -> bool:
    """True if no row of `x` repeats a value."""
    return all(row.unique().numel() == row.numel() for row in x)


@st.composite
def tie_free_logits(draw: st.DrawFn) -> torch.Tensor:
    """float32 `[batch, vocab]` logits, no value repeated within a row.

    Built from a drawn seed (fast; the test notes the tensor itself). The
    spread is log-uniform over [0.05, 20] and every row has its own offset.
    """
    batch = draw(st.integers(1, MAX_BATCH))
    vocab = draw(st.integers(2, MAX_VOCAB))
    seed = draw(st.integers(0, 2**32 - 1))
    scale = 2.0 ** draw(st.floats(-4.3, 4.3))
    offsets = draw(st.lists(st.floats(-20.0, 20.0), min_size=batch, max_size=batch))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, vocab, generator=g) * scale + torch.tensor(offsets)[:, None]
    assume(_tie_free(z))
    return z


def _f32(x: float) -> float:
    """`x` rounded to float32: the value both the spec's tensors and HF receive."""
    return torch.tensor(x, dtype=torch.float32).item()


def _near(draw: st.DrawFn, center: float) -> float:
    """A value close to `center`: inside or just outside the boundary band."""
    sign = draw(st.sampled_from((-1.0, 1.0)))
    return center + sign * 10.0 ** draw(st.floats(-8.0, -2.0))


def _draw_top_p(draw: st.DrawFn, above: torch.Tensor, kept: torch.Tensor) -> float:
    """A top-p value: 1, free, or near the mass above one of the `kept` tokens."""
    kind = draw(st.sampled_from(("one", "free", "near", "near")))
    if kind == "one":
        return 1.0
    if kind == "free":
        return _f32(draw(st.floats(1e-6, 1.0)))
    candidates = above[kept].sort().values
    center = candidates[draw(st.integers(0, candidates.numel() - 1))].item()
    return _f32(min(1.0, max(1e-7, _near(draw, center))))


def _draw_min_p(draw: st.DrawFn, x: torch.Tensor, kept: torch.Tensor) -> float:
    """A min-p value: 0, 1, free (log-uniform), or near the ratio of a kept token."""
    kind = draw(st.sampled_from(("zero", "one", "free", "near", "near")))
    if kind == "zero":
        return 0.0
    if kind == "one":
        return 1.0
    low = math.log(MIN_P_FLOOR)
    if kind == "free":
        return _f32(math.exp(draw(st.floats(low, 0.0))))
    gaps = (x[kept] - x.max()).sort().values
    center = gaps[draw(st.integers(0, gaps.numel() - 1))].item()
    return _f32(math.exp(min(0.0, max(low, _near(draw, center)))))


# ---------------------------------------------------------------------------
# The exact definitions, in float64, on one row


def _mass_above(x: torch.Tensor) -> torch.Tensor:
    """Float64 mass strictly above each token of a tie-free row (−inf: removed)."""
    probs = torch.softmax(x, dim=-1)
    order = x.argsort(descending=True)
    sorted_probs = probs[order]
    above = torch.empty_like(probs)
    above[order] = sorted_probs.cumsum(0) - sorted_probs
    return above


def _band(*magnitudes: float) -> float:
    return BAND + BAND_PER_MAGNITUDE * sum(magnitudes)


def _magnitude(x: torch.Tensor) -> float:
    return x[x > -math.inf].abs().max().item()


def _top_p_exact(x: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kept, band, mass above) of exact top-p on a float64 row (−inf: removed)."""
    finite = x > -math.inf
    above = _mass_above(x)
    if p >= 1:
        return finite, torch.zeros_like(finite), above
    band = finite & ((above - p).abs() < _band(_magnitude(x)))
    return finite & (above < p), band, above


def _min_p_exact(x: torch.Tensor, m: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kept, band, gap) of exact min-p on a float64 row; gap = x − x_max − ln m."""
    finite = x > -math.inf
    if m == 0:
        return finite, torch.zeros_like(finite), torch.full_like(x, math.inf)
    gap = x - x.max() - math.log(m)
    band = finite & (gap.abs() < _band(_magnitude(x), abs(math.log(m))))
    return finite & (gap >= 0), band, gap


def _top_k_exact(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k on a tie-free float64 row: the k largest (k = 0: all)."""
    if k == 0:
        return x > -math.inf
    greater = (x[None, :] > x[:, None]).sum(dim=1)
    return (greater < k) & (x > -math.inf)


# ---------------------------------------------------------------------------
# Comparison


def _assert_same_kept(
    what: str,
    row: int,
    spec: torch.Tensor,
    peer: torch.Tensor,
    exact: torch.Tensor,
    band: torch.Tensor,
    **details: torch.Tensor,
) -> None:
    """spec, HF and the exact definition keep the same tokens outside the band."""
    wrong = ~band & ((spec != peer) | (spec != exact))
    if bool(wrong.any()):
        lines = [f"{what}, row {row}: kept sets differ outside the boundary band"]
        for i in wrong.nonzero().flatten().tolist()[:10]:
            extra = ", ".join(f"{k}={v[i].item()!r}" for k, v in details.items())
            lines.append(
                f"  token {i}: spec={bool(spec[i])} hf={bool(peer[i])} "
                f"exact={bool(exact[i])} {extra}"
            )
        raise AssertionError("\n".join(lines))


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """float64 `x − max x` of a float32 row (exact: both are float32)."""
    x = x.double()
    return x - x.max()


def _hf(warpers: list, row: torch.Tensor) -> torch.Tensor:
    """HF's warpers applied in order to one row, as `generate` does."""
    return hf.LogitsProcessorList(warpers)(NO_INPUT_IDS, row[None].clone())[0]


# ---------------------------------------------------------------------------
# Each warper against its spec stage


@pytest.mark.clause("SOFTMAX-TEMP-1")
@given(z=tie_free_logits(), data=st.data())
def test_temperature_matches_hf_up_to_the_row_shift(z, data):
    """(z − max)/T equals HF's z/T shifted by its maximum, within float32 rounding.

    Both are within `2^-22 · (|z_i| + |z_max|) / T` of the exact value: the
    spec rounds `z − max` and the quotient, HF rounds `z/T` and `max/T`.
    """
    batch = z.shape[0]
    t = torch.tensor(
        [_f32(2.0 ** data.draw(st.floats(-6.6, 6.6))) for _ in range(batch)], dtype=torch.float32
    )
    note(f"logits = {source(z)}")
    note(f"temperature = {source(t)}")
    spec = apply_temperature(z, t)
    assert torch.equal(process_logits(z, temperature=t), spec)
    for r in range(batch):
        peer = hf.TemperatureLogitsWarper(t[r].item())(NO_INPUT_IDS, z[r : r + 1].clone())[0]
        largest = z[r].abs().max().item()
        tol = 2.0**-22 * (z[r].double().abs() + abs(z[r].max().item())) / t[r].item()
        error = (spec[r].double() - _shifted(peer)).abs()
        assert bool((error <= tol).all()), (
            f"row {r}: max error {error.max().item()!r} over tolerance "
            f"{tol[error.argmax()].item()!r} (T={t[r].item()!r}, max|z|={largest!r})"
        )
        assert spec[r].argmax() == peer.argmax() == z[r].argmax()
        assert spec[r].max().item() == 0.0


@pytest.mark.clause("SAMPLE-TOPK-1", "SAMPLE-TOPK-2")
@given(z=tie_free_logits(), data=st.data())
def test_top_k_matches_hf(z, data):
    """Same kept set and same values as `TopKLogitsWarper` (k = 0: the spec keeps all)."""
    batch, vocab = z.shape
    k = torch.tensor(
        [data.draw(st.integers(0, vocab + 3)) for _ in range(batch)], dtype=torch.int64
    )
    note(f"logits = {source(z)}")
    note(f"top_k = {source(k)}")
    spec = top_k_mask(z, k)
    values = process_logits(z, temperature=torch.ones(batch), top_k=k)
    assert torch.equal(values > -math.inf, spec)
    for r in range(batch):
        kr = int(k[r])
        peer = _hf([hf.TopKLogitsWarper(kr)] if kr else [], z[r])
        kept = peer > -math.inf
        exact = _top_k_exact(z[r].double(), kr)
        _assert_same_kept("top_k_mask", r, spec[r], kept, exact, torch.zeros_like(kept))
        assert torch.equal(values[r][kept], (peer - peer.max())[kept])


@pytest.mark.clause("SAMPLE-TOPP-1", "SAMPLE-TOPP-2")
@given(z=tie_free_logits(), data=st.data())
def test_top_p_matches_hf_outside_the_boundary_band(z, data):
    """Same kept set as `TopPLogitsWarper` where `|mass above − p| >= band`; same values."""
    batch = z.shape[0]
    x = z.double()
    p = torch.tensor(
        [_draw_top_p(data.draw, _mass_above(x[r]), x[r] > -math.inf) for r in range(batch)],
        dtype=torch.float32,
    )
    note(f"logits = {source(z)}")
    note(f"top_p = {source(p)}")
    spec = top_p_mask(z, p)
    values = process_logits(z, temperature=torch.ones(batch), top_p=p)
    for r in range(batch):
        # As in `generate`, p = 1 adds no warper (see test_top_p_one_hf_warper_...).
        peer = _hf([hf.TopPLogitsWarper(p[r].item())] if p[r] < 1 else [], z[r])
        kept = peer > -math.inf
        exact, band, above = _top_p_exact(x[r], p[r].item())
        _assert_same_kept("top_p_mask", r, spec[r], kept, exact, band, mass_above=above)
        piped = values[r] > -math.inf
        _assert_same_kept("process_logits", r, piped, kept, exact, band, mass_above=above)
        both = piped & kept
        assert torch.equal(values[r][both], (peer - peer.max())[both])


@pytest.mark.clause("SAMPLE-MINP-1")
@given(z=tie_free_logits(), data=st.data())
def test_min_p_matches_hf_outside_the_boundary_band(z, data):
    """Same kept set as `MinPLogitsWarper` where `|ln π_i − ln π_max − ln m| >= band`.

    min-p values are drawn from {0, 1} ∪ [1e-30, 1], where `m · π_max` is a
    normal float32 and HF's probability comparison is as precise as the spec's.
    """
    batch = z.shape[0]
    x = z.double()
    m = torch.tensor(
        [_draw_min_p(data.draw, x[r], x[r] > -math.inf) for r in range(batch)],
        dtype=torch.float32,
    )
    note(f"logits = {source(z)}")
    note(f"min_p = {source(m)}")
    spec = min_p_mask(z, m)
    values = process_logits(z, temperature=torch.ones(batch), min_p=m)
    for r in range(batch):
        peer = _hf([hf.MinPLogitsWarper(m[r].item())], z[r])
        kept = peer > -math.inf
        exact, band, gap = _min_p_exact(x[r], m[r].item())
        _assert_same_kept("min_p_mask", r, spec[r], kept, exact, band, log_ratio_minus_ln_m=gap)
        piped = values[r] > -math.inf
        _assert_same_kept("process_logits", r, piped, kept, exact, band, log_ratio_minus_ln_m=gap)
        both = piped & kept
        assert torch.equal(values[r][both], (peer - peer.max())[both])


# ---------------------------------------------------------------------------
# The composed pipeline


@pytest.mark.clause(
    "SAMPLE-ORDER-1", "SOFTMAX-TEMP-1", "SAMPLE-TOPK-1", "SAMPLE-TOPP-1", "SAMPLE-MINP-1"
)
@given(z=tie_free_logits(), data=st.data())
def test_pipeline_matches_hf_warpers_in_the_same_order(z, data):
    """temperature → top-k → top-p → min-p equals HF's warpers as `generate` builds them.

    HF's `generate` adds `TemperatureLogitsWarper`, then `TopKLogitsWarper`
    unless k = 0, `TopPLogitsWarper` unless p = 1, then `MinPLogitsWarper`,
    in that order; so does this test. top-p sees the distribution renormalised
    after top-k in both. Kept sets agree outside the boundary band of the
    top-p and min-p stages; kept values agree up to the row shift.
    """
    batch, vocab = z.shape
    t = torch.tensor(
        [_f32(2.0 ** data.draw(st.floats(-4.3, 3.3))) for _ in range(batch)], dtype=torch.float32
    )
    # The scaled rows must be tie-free too (both roundings of z / T).
    assume(_tie_free(apply_temperature(z, t)) and _tie_free(z / t[:, None]))
    k = torch.tensor(
        [
            data.draw(
                st.sampled_from((0, 1, 2, vocab // 2, vocab, vocab + 3)) | st.integers(0, vocab)
            )
            for _ in range(batch)
        ],
        dtype=torch.int64,
    )
    x = z.double() / t.double()[:, None]
    after_k = [_top_k_exact(x[r], int(k[r])) for r in range(batch)]
    x_k = [x[r].masked_fill(~after_k[r], -math.inf) for r in range(batch)]
    p = torch.tensor(
        [_draw_top_p(data.draw, _mass_above(x_k[r]), after_k[r]) for r in range(batch)],
        dtype=torch.float32,
    )
    m = torch.tensor(
        [_draw_min_p(data.draw, x[r], after_k[r]) for r in range(batch)], dtype=torch.float32
    )
    note(f"logits = {source(z)}")
    note(f"temperature, top_k, top_p, min_p = {source([t, k, p, m])}")

    spec_values = process_logits(z, temperature=t, top_k=k, top_p=p, min_p=m)
    spec = spec_values > -math.inf
    for r in range(batch):
        kr, pr, mr = int(k[r]), p[r].item(), m[r].item()
        warpers = [hf.TemperatureLogitsWarper(t[r].item())]
        warpers += [hf.TopKLogitsWarper(kr)] if kr else []
        warpers += [hf.TopPLogitsWarper(pr)] if pr < 1 else []
        warpers += [hf.MinPLogitsWarper(mr)]
        peer = _hf(warpers, z[r])
        kept = peer > -math.inf

        kept_p, band_p, above = _top_p_exact(x_k[r], pr)
        kept_m, band_m, gap = _min_p_exact(x[r], mr)
        exact = after_k[r] & kept_p & kept_m
        band = after_k[r] & (band_p | band_m)
        _assert_same_kept(
            "pipeline", r, spec[r], kept, exact, band, mass_above=above, log_ratio_minus_ln_m=gap
        )

        both = spec[r] & kept
        tol = 2.0**-22 * (z[r].double().abs() + abs(z[r].max().item())) / t[r].item()
        error = (spec_values[r].double() - _shifted(peer))[both].abs()
        assert bool((error <= tol[both]).all()), f"row {r}: kept values differ by {error.max()}"


# ---------------------------------------------------------------------------
# Repetition penalty


@pytest.mark.clause("LOGITS-REP-1")
@given(z=tie_free_logits(), data=st.data())
def test_repetition_penalty_matches_hf_bit_for_bit(z, data):
    """Same float32 values as `RepetitionPenaltyLogitsProcessor` over prompt + output.

    HF multiplies when `z < 0` and divides otherwise, the spec divides when
    `z > 0` and multiplies otherwise: they differ only at ±0, where both give
    the same signed zero. Rows hold some 0.0, −0.0 and −inf entries; tokens
    repeat within the prompt and the output.
    """
    batch, vocab = z.shape
    z = z.clone()
    prompts, outputs = [], []
    for r in range(batch):
        for value in (0.0, -0.0, -math.inf):
            for i in data.draw(st.lists(st.integers(0, vocab - 1), max_size=3)):
                z[r, i] = value
        prompts.append(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20)))
        outputs.append(data.draw(st.lists(st.integers(0, vocab - 1), max_size=20)))
    theta = torch.tensor(
        [data.draw(st.sampled_from((1.0, 1.2, 0.8)) | st.floats(1e-3, 1e3)) for _ in range(batch)],
        dtype=torch.float32,
    )
    note(f"logits = {source(z)}")
    note(f"prompt_token_ids, output_token_ids = {prompts!r}, {outputs!r}")
    note(f"repetition_penalty = {source(theta)}")

    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool)
    counts = torch.zeros(batch, vocab, dtype=torch.int64)
    for r in range(batch):
        prompt_mask[r, prompts[r]] = True
        counts[r] = torch.bincount(torch.tensor(outputs[r], dtype=torch.int64), minlength=vocab)
    zero = torch.zeros(batch)
    spec = apply_penalties(z, prompt_mask, counts, theta, zero, zero)
    for r in range(batch):
        input_ids = torch.tensor([prompts[r] + outputs[r]], dtype=torch.long)
        processor = hf.RepetitionPenaltyLogitsProcessor(theta[r].item())
        peer = processor(input_ids, z[r : r + 1].clone())[0]
        differ = spec[r].view(torch.int32) != peer.view(torch.int32)
        assert not bool(differ.any()), (
            f"row {r}: tokens {differ.nonzero().flatten().tolist()} differ: "
            f"spec {spec[r][differ].tolist()} hf {peer[differ].tolist()}"
        )


# ---------------------------------------------------------------------------
# Where the spec and HF differ (fixed inputs)


def _hf_kept(warper, z: torch.Tensor) -> set[int]:
    return set((_hf([warper], z) > -math.inf).nonzero().flatten().tolist())


def _spec_kept(mask: torch.Tensor) -> set[int]:
    return set(mask[0].nonzero().flatten().tolist())


@pytest.mark.clause("SAMPLE-TOPP-2")
@pytest.mark.parametrize(
    "probs", [(0.4, 0.3, 0.3), (0.3, 0.4, 0.3), (0.3, 0.3, 0.4)], ids=["first", "middle", "last"]
)
def test_top_p_tie_group_across_the_threshold_differs_from_hf(probs):
    """Difference: probabilities {0.4, 0.3, 0.3}, p = 0.5.

    The mass strictly above either 0.3 token is 0.4 < 0.5, so the spec keeps
    both tied tokens (and the 0.4 one). HF sorts ascending, its cumulative sum
    is 0.3, 0.6, 1.0 and it removes entries `<= 1 − p = 0.5`: it drops
    exactly one of the two tied tokens (which one depends on the sort).
    """
    z = torch.tensor([probs]).log()
    p = 0.5
    spec = _spec_kept(top_p_mask(z, torch.tensor([p])))
    peer = _hf_kept(hf.TopPLogitsWarper(p), z[0])
    big = probs.index(0.4)
    tied = {i for i, q in enumerate(probs) if q == 0.3}
    assert spec == {0, 1, 2}
    assert big in peer
    assert len(peer & tied) == 1
    assert len(peer) == 2


@pytest.mark.clause("SAMPLE-TOPP-1", "SAMPLE-TOPP-2")
@pytest.mark.parametrize(
    ("probs", "p", "kept"),
    [
        ((0.6, 0.2, 0.2), 0.55, {0}),  # mass above the tied pair 0.6 >= 0.55: both dropped
        ((0.2, 0.6, 0.2), 0.55, {1}),
        ((0.5, 0.25, 0.25), 0.5, {0}),  # 0.5 is not < 0.5: dropped together (exact binary)
        ((0.2, 0.2, 0.6), 0.9, {0, 1, 2}),  # 0.6 < 0.9: kept together
        ((0.25, 0.5, 0.25, 0.0), 0.8, {0, 1, 2}),  # prob 0: dropped by both
    ],
)
def test_top_p_tie_group_not_split_by_hf_agrees(probs, p, kept):
    """Agreement: when `1 − p` does not fall inside a tie group's cumulative range,
    HF keeps or drops the group whole, as the spec does."""
    z = torch.tensor([probs]).log()
    assert _spec_kept(top_p_mask(z, torch.tensor([p]))) == kept
    assert _hf_kept(hf.TopPLogitsWarper(p), z[0]) == kept


@pytest.mark.clause("SAMPLE-TOPK-2")
@pytest.mark.parametrize(
    ("logits", "k", "kept"),
    [
        ((3.0, 1.0, 2.0, 2.0), 2, {0, 2, 3}),
        ((5.0, 5.0, 5.0, 1.0), 1, {0, 1, 2}),
        ((4.0, 2.0, 2.0, 2.0, 1.0), 3, {0, 1, 2, 3}),
        ((1.0, 1.0, 1.0), 2, {0, 1, 2}),
        ((0.0, 7.0, -1.0, 7.0), 2, {1, 3}),
    ],
)
def test_top_k_ties_agree_with_hf(logits, k, kept):
    """Agreement on ties: HF's `TopKLogitsWarper` removes `z < (k-th largest value)`,
    so it too keeps every token tied with the k-th value; more than k survive."""
    z = torch.tensor([logits])
    assert _spec_kept(top_k_mask(z, torch.tensor([k]))) == kept
    assert _hf_kept(hf.TopKLogitsWarper(k), z[0]) == kept


@pytest.mark.clause("SAMPLE-TOPP-1", "SAMPLE-TOPP-2")
def test_top_p_distinct_logits_with_equal_float32_probabilities():
    """Distinct logits whose float32 probabilities round equal are not a tie.

    Logits 0, −0.25 and the next float32 below −0.25 have probabilities
    0.391, 0.3045043452 and 0.3045043361 (float64); float32 softmax gives the
    last two the same value. "Above" compares logits (SAMPLE-TOPP-1), so the
    mass above token 2 is 0.695 >= 0.5 and only {0, 1} are kept, as HF and
    the exact definition keep. (Comparing rounded probabilities kept all three.)
    """
    a = torch.tensor(-0.25)
    z = torch.stack([torch.tensor(0.0), a, torch.nextafter(a, torch.tensor(-1.0))])[None]
    assert _tie_free(z)
    probs = softmax(z)[0]
    assert probs[1].item() == probs[2].item()
    p = 0.5
    exact = (_mass_above(z[0].double()) < p).nonzero().flatten().tolist()
    assert set(exact) == {0, 1}
    assert _hf_kept(hf.TopPLogitsWarper(p), z[0]) == {0, 1}
    assert _spec_kept(top_p_mask(z, torch.tensor([p]))) == {0, 1}


@pytest.mark.clause("SAMPLE-TOPP-1")
def test_top_p_one_hf_warper_drops_underflowed_tokens():
    """Difference: `TopPLogitsWarper(1.0)` removes tokens whose float32 probability is 0
    (cumulative sum 0 <= 1 − 1), the spec's p = 1 keeps every finite token.
    (HF's `generate` does not add the warper when top_p == 1, so this is not
    visible there.)"""
    z = torch.tensor([[0.0, -50.0, -120.0]])
    assert _spec_kept(top_p_mask(z, torch.tensor([1.0]))) == {0, 1, 2}
    assert _hf_kept(hf.TopPLogitsWarper(1.0), z[0]) == {0, 1}


@pytest.mark.clause("SOFTMAX-TEMP-1")
def test_tiny_temperature_overflows_in_hf_not_in_the_spec():
    """Difference: HF divides first, so z / T overflows to +inf for a tiny T (its
    softmax is then NaN); the spec subtracts the maximum first and stays valid."""
    z = torch.tensor([[100.0, 200.0]])
    t = 1e-37
    assert apply_temperature(z, torch.tensor([t])).tolist() == [[-math.inf, 0.0]]
    assert hf.TemperatureLogitsWarper(t)(NO_INPUT_IDS, z.clone()).tolist() == [[math.inf, math.inf]]
