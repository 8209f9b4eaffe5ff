"""Conformance: the sampling stage where implementations actually differ.

Random logits almost never put two equal values in different chunks of a
chunked kernel, or a token exactly on a filter's threshold. These tests
build such rows on purpose (tests/strategies.py, "boundaries"), and every
expected answer is exact: ties are equal values and the thresholds are hit
with arithmetic every float32 implementation does exactly (dyadic
probabilities, powers of two), so no rounding margin is needed or allowed.

- ties-across-chunks: the tied ids lie below 1024 and in different multiples
  of 4096, so they sit in different chunks of a kernel that walks the
  vocabulary 1024 entries at a time (ours on a GPU) or 4096 (ours in the
  interpreter);
- exact-thresholds: top-p where the mass above a token equals p, min-p where
  a token equals `z_max + ln m`, with and without a temperature.

Each filter is asked twice: through its mask operation (`top_k_mask`, ...) and
through `process_logits` with only that filter on, which is where a fused
sampling kernel (ours, FlashInfer's) does the work; greedy likewise through
`greedy` and through `sample` at temperature 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from decodespec.spec.softmax import softmax
from tests import oracle
from tests.strategies import (
    DEVICE,
    FLOAT_DTYPES,
    dyadic_probabilities,
    far_apart_ids,
    make_logits,
)

REL = 2.0**-21  # as tests/conformance/test_sampling.py


def row_below(data: st.DataObject, vocab: int, top: float, dtype: torch.dtype) -> torch.Tensor:
    """`[1, vocab]` random logits, all below `top` (some −inf), rounded to `dtype`."""
    kind = data.draw(st.sampled_from(("normal", "integers", "bf16_rounded")))
    fraction = data.draw(st.sampled_from((0.0, 0.3)))
    x = make_logits(1, vocab, kind, data.draw(st.integers(0, 2**32 - 1)), fraction)
    return (top - 0.5 - x.abs()).to(dtype)


THROUGH = ("mask", "process_logits")


def kept_by(impl, through: str, x: torch.Tensor, name: str, value) -> torch.Tensor:
    """`[1, vocab]` bool: the tokens the filter `name` (top_k, top_p, min_p) keeps
    with `value`, asked through its mask operation or through `process_logits`
    (temperature 1, no other filter: the kept tokens are the finite ones)."""
    dtype = torch.int64 if name == "top_k" else torch.float32
    parameter = torch.tensor([value], dtype=dtype, device=DEVICE)
    if through == "mask":
        return impl.op(f"{name}_mask")(x.to(DEVICE), parameter).cpu()
    one = torch.ones(1, device=DEVICE)
    out = impl.op("process_logits")(x.to(DEVICE), temperature=one, **{name: parameter})
    return torch.isfinite(out).cpu()


def greedy_by(impl, through: str, x: torch.Tensor) -> int:
    """The greedy token of one row, through `greedy` or through `sample` at temperature 0."""
    if through == "mask":
        return impl.op("greedy")(x.to(DEVICE)).item()
    zero = torch.zeros(1, device=DEVICE)
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    return impl.op("sample")(x.to(DEVICE), temperature=zero, seed=index, step=index).item()


def assert_keeps_exactly(mask: torch.Tensor, ids: list[int]) -> None:
    """`mask` (`[1, vocab]`) keeps the tokens `ids` and no other."""
    kept = mask[0].nonzero().flatten().tolist()
    assert kept == sorted(ids), f"kept {kept}, expected {sorted(ids)}"


def other_ids(data: st.DataObject, vocab: int, taken: list[int], count: int) -> list[int]:
    """`count` distinct ids of the row outside `taken`."""
    free = st.integers(0, vocab - 1).filter(lambda i: i not in taken)
    return data.draw(st.lists(free, min_size=count, max_size=count, unique=True))


# ---------------------------------------------------------------- ties across chunks


@pytest.mark.clause("SAMPLE-GREEDY-1")
@pytest.mark.boundary("ties-across-chunks")
@pytest.mark.parametrize("through", THROUGH)
@given(data=st.data())
def test_greedy_ties_across_chunks_go_to_the_smallest_index(impl, through, data):
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    vocab, tied = data.draw(far_apart_ids(data.draw(st.integers(2, 3))))
    x = row_below(data, vocab, 1.0, dtype)
    x[0, tied] = 1.0
    note(f"vocab={vocab} tied ids={tied}")
    assert greedy_by(impl, through, x) == min(tied)


@pytest.mark.clause("SAMPLE-TOPK-2")
@pytest.mark.boundary("ties-across-chunks")
@pytest.mark.parametrize("through", THROUGH)
@given(data=st.data())
def test_top_k_keeps_ties_at_the_boundary_in_every_chunk(impl, through, data):
    """The k-th largest value is shared by tokens in far-apart chunks: all kept."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    count = data.draw(st.integers(2, 3))
    vocab, tied = data.draw(far_apart_ids(count))
    above = other_ids(data, vocab, tied, data.draw(st.integers(0, 3)))
    x = row_below(data, vocab, 0.0, dtype)
    x[0, tied] = 0.0
    x[0, above] = torch.arange(1, len(above) + 1, dtype=dtype)
    k = len(above) + data.draw(st.integers(1, count))
    note(f"vocab={vocab} tied ids={tied} above={above} k={k}")
    mask = kept_by(impl, through, x, "top_k", k)
    assert_keeps_exactly(mask, tied + above)


@pytest.mark.clause("SAMPLE-TOPP-2")
@pytest.mark.boundary("ties-across-chunks")
@pytest.mark.parametrize("through", THROUGH)
@given(data=st.data())
def test_top_p_keeps_the_tied_crossing_tokens_in_every_chunk(impl, through, data):
    """Tokens tied with the crossing token sit in far-apart chunks: kept together.

    One or two tokens at 0 carry mass a < p; the tied tokens at −1 cross p;
    the rest sit below −40, with a negligible mass, and are dropped.
    """
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    count = data.draw(st.integers(2, 3))
    vocab, tied = data.draw(far_apart_ids(count))
    above = other_ids(data, vocab, tied, data.draw(st.integers(1, 2)))
    x = row_below(data, vocab, -40.0, dtype)
    x[0, above] = 0.0
    x[0, tied] = -1.0
    mass_above = len(above) / (len(above) + count * math.exp(-1))
    p = mass_above + data.draw(st.floats(0.1, 0.9)) * (1 - mass_above)
    note(f"vocab={vocab} tied ids={tied} above={above} p={p}")
    mask = kept_by(impl, through, x, "top_p", p)
    assert_keeps_exactly(mask, tied + above)


@pytest.mark.clause("SAMPLE-MINP-1")
@pytest.mark.boundary("ties-across-chunks")
@pytest.mark.parametrize("through", THROUGH)
@given(data=st.data())
def test_min_p_measures_every_chunk_against_the_rows_maximum(impl, through, data):
    """The row's maximum is tied in far-apart chunks; every other token lies at
    least 2 below it, so a chunk without the maximum must not use its own."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    vocab, tied = data.draw(far_apart_ids(data.draw(st.integers(2, 3))))
    x = row_below(data, vocab, -1.5, dtype)
    x[0, tied] = 0.0
    m = torch.tensor([data.draw(st.floats(0.05, 0.95))])
    note(f"vocab={vocab} tied ids={tied} min_p={m.item()}")
    mask = kept_by(impl, through, x, "min_p", m.item())
    oracle.assert_between(mask, oracle.min_p(x, x > -math.inf, m, REL), "min_p")


@pytest.mark.clause("LOGPROB-TOP-1", "LOGPROB-RANK-1")
@pytest.mark.boundary("ties-across-chunks")
@given(data=st.data())
def test_top_logprobs_order_ties_across_chunks_by_id(impl, data):
    """The most likely value is shared by tokens in far-apart chunks: the top list
    starts with them in increasing id, and each has rank 1."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES))
    count = data.draw(st.integers(2, 3))
    vocab, tied = data.draw(far_apart_ids(count))
    x = row_below(data, vocab, 1.0, dtype)
    x[0, tied] = 1.0
    chosen = data.draw(st.sampled_from(tied))
    n = data.draw(st.integers(count, 20))
    note(f"vocab={vocab} tied ids={tied} chosen={chosen} n={n}")
    out = impl.op("compute_logprobs")(x.to(DEVICE), torch.tensor([chosen], device=DEVICE), n)
    assert out.top_token_ids.cpu()[0, :count].tolist() == sorted(tied)
    assert out.ranks.cpu().tolist() == [1]


# ---------------------------------------------------------------- exact thresholds


@st.composite
def dyadic_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`(x, probs, p)`: float32 logits whose softmax is exactly a dyadic distribution
    (probabilities 2^-e, the rest of the row −inf), and a p equal to the exact mass
    above one of its values."""
    exponents = dyadic_probabilities(draw)
    levels = sorted(set(exponents))
    assume(len(levels) > 1)
    vocab = draw(st.integers(len(exponents), len(exponents) + 40))
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 999))))
    probs = torch.zeros(1, vocab, dtype=torch.float64)
    probs[0, ids[: len(exponents)]] = 2.0 ** -torch.tensor(exponents, dtype=torch.float64)
    x = probs.log().float()
    # Exact in float32 too: exp of the max-subtracted logits rounds to the powers of two.
    assume(torch.equal(softmax(x).double(), probs))
    level = draw(st.sampled_from(levels[1:]))
    p = sum(2.0**-e for e in exponents if e < level)
    return x, probs, p


@pytest.mark.clause("SAMPLE-TOPP-1", "SAMPLE-TOPP-2")
@pytest.mark.boundary("exact-thresholds")
@pytest.mark.parametrize("through", THROUGH)
@given(row=dyadic_rows())
def test_top_p_drops_a_token_whose_mass_above_equals_p(impl, through, row):
    """Probabilities 1/2, 1/4, 1/4 ... (exact in float32): the tokens with exactly p
    of mass above them are dropped (`< p`), those with less are kept."""
    x, probs, p = row
    mass_above = torch.tensor(
        [[probs[0][probs[0] > probs[0, i]].sum().item() for i in range(x.shape[1])]]
    )
    expected = (mass_above < p) & (probs > 0)
    note(f"probs={probs[probs > 0].tolist()} p={p}")
    assert kept_by(impl, through, x, "top_p", p).tolist() == expected.tolist()


def exact_log_powers_of_two() -> list[int]:
    """k with float32 ln 2^-k within 0.1 ulp of the true value: every faithful `log`
    gives that float, so a token placed on it is exactly at the threshold."""
    exact = []
    for k in range(1, 16):
        rounded = torch.tensor(2.0**-k).log().item()
        ulp = 2.0 ** (math.floor(math.log2(abs(rounded))) - 23)  # float32 spacing there
        if abs(rounded + k * math.log(2)) <= 0.1 * ulp:
            exact.append(k)
    return exact


@pytest.mark.clause("SAMPLE-MINP-1")
@pytest.mark.boundary("exact-thresholds")
@pytest.mark.parametrize("through", THROUGH)
@given(data=st.data(), k=st.sampled_from(exact_log_powers_of_two()))
def test_min_p_keeps_a_token_exactly_at_the_threshold(impl, through, data, k):
    """m = 2^-k, the maximum 0 and tokens at exactly ln m: kept (`>=`)."""
    vocab = data.draw(st.integers(3, 300))
    x = row_below(data, vocab, 0.0, torch.float32)
    at = other_ids(data, vocab, [], data.draw(st.integers(1, 3)))
    top = other_ids(data, vocab, at, 1)
    ln_m = torch.tensor(2.0**-k).log().item()
    x[0, top] = 0.0
    x[0, at] = ln_m
    note(f"k={k} ln m={ln_m} max at {top}, tokens at ln m: {at}")
    mask = kept_by(impl, through, x, "min_p", 2.0**-k)
    assert mask[0, at].all() and mask[0, top].all()
    assert mask.tolist() == (x >= ln_m).tolist()


@pytest.mark.clause("SAMPLE-MINP-1", "SAMPLE-ORDER-1")
@pytest.mark.boundary("exact-thresholds")
@given(
    data=st.data(),
    k=st.sampled_from(exact_log_powers_of_two()),
    temperature=st.sampled_from((0.25, 0.5, 2.0, 4.0)),
)
def test_min_p_threshold_is_on_the_scaled_logits(impl, data, k, temperature):
    """Temperature T (a power of two: the scaling is exact) and min-p m = 2^-k:
    tokens at T · ln m are exactly at the threshold of the scaled logits, kept;
    the unscaled threshold would put them T times too far from it."""
    vocab = data.draw(st.integers(3, 300))
    x = row_below(data, vocab, 0.0, torch.float32) * temperature
    at = other_ids(data, vocab, [], data.draw(st.integers(1, 3)))
    top = other_ids(data, vocab, at, 1)
    ln_m = torch.tensor(2.0**-k).log().item()
    x[0, top] = 0.0
    x[0, at] = ln_m * temperature
    note(f"k={k} T={temperature} tokens at T ln m: {at}")
    out = impl.op("process_logits")(
        x.to(DEVICE),
        temperature=torch.tensor([temperature], device=DEVICE),
        min_p=torch.tensor([2.0**-k], device=DEVICE),
    ).cpu()
    assert torch.isfinite(out[0, at]).all(), "a token exactly at the threshold was dropped"
    assert torch.isfinite(out).tolist() == (x / temperature >= ln_m).tolist()
