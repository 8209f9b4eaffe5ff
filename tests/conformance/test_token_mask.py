"""Conformance: the token mask stage (a grammar's packed bitmask applied to the logits).

The operation is exact: every output is compared bit for bit with the spec on
the same inputs, and with the definition written out here a bit at a time
(`expected`), which checks the spec itself when it is the implementation
under test. Vocabularies cross the 32-bit words and the vocabulary blocks of
chunked kernels (tests/strategies.py, CHUNK_SIZES).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec.spec import registry
from decodespec.spec.sampling import invalid_rows
from tests.strategies import CHUNK_SIZES, DEVICE, FLOAT_DTYPES, MAX_BATCH, logits, make_logits

FEATURE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
BIT_TYPES = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def apply(impl, x, bitmask, indices=None):
    """The implementation's `apply_token_bitmask`, with the features its dtype needs."""
    if x.dtype in FEATURE:
        impl.require(FEATURE[x.dtype])
    if indices is None:
        return impl.op("apply_token_bitmask")(x, bitmask)
    return impl.op("apply_token_bitmask")(x, bitmask, indices=indices)


def reference(x, bitmask, indices=None):
    return registry.OPERATIONS["apply_token_bitmask"].reference(x, bitmask, indices)


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that NaN compares equal to the same NaN."""
    return x.contiguous().view(BIT_TYPES[x.dtype]).cpu()


def assert_bit_equal(out: torch.Tensor, want: torch.Tensor) -> None:
    assert out.dtype == want.dtype, (out.dtype, want.dtype)
    assert out.shape == want.shape, (out.shape, want.shape)
    assert torch.equal(bits(out), bits(want)), (
        f"differs at {(bits(out) != bits(want)).nonzero().tolist()[:10]}"
    )


def allowed_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[batch, vocab]` bool, one token at a time: bit t % 32 of word t // 32, read as an
    unsigned 32-bit word; tokens past the words are not allowed."""
    words = bitmask.cpu().to(torch.int64) & 0xFFFFFFFF
    allowed = torch.zeros(bitmask.shape[0], vocab, dtype=torch.bool)
    for t in range(min(vocab, 32 * words.shape[1])):
        allowed[:, t] = (words[:, t // 32] >> (t % 32)) & 1 == 1
    return allowed


def expected(x, bitmask, indices=None):
    """MASK-APPLY-1 and MASK-ROWS-1 written out: allowed entries kept, the others −inf,
    rows outside `indices` untouched."""
    allowed = allowed_bits(bitmask, x.shape[1])
    if indices is not None:
        masked_rows = torch.zeros(x.shape[0], dtype=torch.bool)
        masked_rows[indices.cpu().long()] = True
        allowed |= ~masked_rows[:, None]
    return x.cpu().masked_fill(~allowed, -math.inf)


def random_bitmask(batch: int, words: int, kind: str, seed: int) -> torch.Tensor:
    """`[batch, words]` int32 words on DEVICE: random bits, all, none, or sparse bits."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        w = torch.randint(-(2**31), 2**31, (batch, words), generator=g, dtype=torch.int64)
    elif kind == "all":
        w = torch.full((batch, words), -1, dtype=torch.int64)
    elif kind == "none":
        w = torch.zeros(batch, words, dtype=torch.int64)
    elif kind == "sparse":  # a few bits set: most tokens disallowed
        w = torch.zeros(batch, words, dtype=torch.int64)
        for _ in range(3):
            bit = torch.randint(32, (batch, words), generator=g)
            w |= torch.where(torch.rand(batch, words, generator=g) < 0.5, 1 << bit, 0)
        w = torch.where(w >= 2**31, w - 2**32, w)
    else:
        raise ValueError(kind)
    return w.to(torch.int32).to(DEVICE)


@st.composite
def bitmasks(draw: st.DrawFn, batch: int, vocab: int, narrower: bool = True) -> torch.Tensor:
    """A bitmask for `[batch, vocab]` logits: `ceil(V / 32)` words, or fewer (logits wider
    than the mask), or more (a mask wider than needed)."""
    need = (vocab + 31) // 32
    choices = [need, need, need + 1, need + 3] + ([max(1, need - 1), 1] if narrower else [])
    words = draw(st.sampled_from(choices))
    kind = draw(st.sampled_from(("random", "random", "sparse", "all", "none")))
    return random_bitmask(batch, words, kind, draw(st.integers(0, 2**32 - 1)))


def poisoned(x: torch.Tensor, seed: int, fraction: float = 0.2) -> torch.Tensor:
    """`x` with NaN, +inf and −inf at random entries."""
    g = torch.Generator().manual_seed(seed)
    x = x.clone()
    where = (torch.rand(x.shape, generator=g) < fraction).to(x.device)
    choice = torch.randint(3, x.shape, generator=g).to(x.device)
    for value, which in ((math.nan, 0), (math.inf, 1), (-math.inf, 2)):
        x = x.masked_fill(where & (choice == which), value)
    return x


FLOATS = (*FLOAT_DTYPES, torch.float64)


# ---------------------------------------------------------------- layout and values


@pytest.mark.clause("MASK-LAYOUT-1", "MASK-APPLY-1", "MASK-WIDTH-1")
@given(x=logits(dtypes=FLOATS), data=st.data())
def test_mask_matches_reference(impl, x, data):
    bitmask = data.draw(bitmasks(x.shape[0], x.shape[1]))
    if data.draw(st.booleans()):
        x = poisoned(x, data.draw(st.integers(0, 2**32 - 1)))
    note(f"logits {list(x.shape)} {x.dtype}, bitmask {list(bitmask.shape)}")
    out = apply(impl, x, bitmask)
    assert_bit_equal(out, reference(x, bitmask))
    assert_bit_equal(out.cpu(), expected(x, bitmask))


@pytest.mark.clause("MASK-LAYOUT-1")
@pytest.mark.parametrize("token", [0, 1, 2, 15, 30, 31, 32, 33, 62, 63, 64, 99])
def test_each_bit_allows_its_own_token(impl, token):
    """Bit 0 is the least significant: one set bit allows exactly one token."""
    vocab = 100
    x = make_logits(2, vocab, "normal", seed=token).to(DEVICE)
    words = torch.zeros(2, 4, dtype=torch.int64)
    words[0, token // 32] = 1 << (token % 32)
    words[1] = -1  # every token, row 1
    words[1, token // 32] = ~(1 << (token % 32))  # every token but this one
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    out = apply(impl, x, bitmask).cpu()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [token]
    assert out[0, token] == x[0, token].cpu()
    assert (~torch.isfinite(out[1])).nonzero().flatten().tolist() == [token]


@pytest.mark.clause("MASK-LAYOUT-1")
@pytest.mark.parametrize(
    ("word", "allowed"),
    [
        (-1, list(range(32))),
        (-(2**31), [31]),
        (2**31 - 1, list(range(31))),
        (-2, list(range(1, 32))),
    ],
)
def test_the_sign_of_a_word_is_one_of_its_bits(impl, word, allowed):
    x = make_logits(1, 32, "normal", seed=7).to(DEVICE)
    out = apply(impl, x, torch.tensor([[word]], dtype=torch.int32, device=DEVICE)).cpu()
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == allowed


@pytest.mark.clause("MASK-APPLY-1")
@given(x=logits(dtypes=FLOATS, masked=False), data=st.data())
def test_all_but_one_token_masked(impl, x, data):
    batch, vocab = x.shape
    keep = [data.draw(st.integers(0, vocab - 1)) for _ in range(batch)]
    words = torch.zeros(batch, (vocab + 31) // 32, dtype=torch.int64)
    for row, token in enumerate(keep):
        words[row, token // 32] = 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    out = apply(impl, x, bitmask)
    assert_bit_equal(out, reference(x, bitmask))
    for row, token in enumerate(keep):
        assert torch.isfinite(out[row]).nonzero().flatten().tolist() == [token]


@pytest.mark.clause("MASK-APPLY-1")
@given(data=st.data())
def test_ties_between_masked_and_allowed_tokens(impl, data):
    """Integer logits tie often: masking one of two equal logits leaves the other as it was,
    and the greedy token of the masked row is the allowed one."""
    batch = data.draw(st.integers(1, MAX_BATCH))
    vocab = data.draw(st.integers(2, 200))
    x = make_logits(batch, vocab, "integers", data.draw(st.integers(0, 2**32 - 1))).to(DEVICE)
    bitmask = random_bitmask(batch, (vocab + 31) // 32, "random", data.draw(st.integers(0, 99)))
    allowed = allowed_bits(bitmask, vocab)
    first = torch.arange(batch)
    token = data.draw(st.integers(0, vocab - 1))
    allowed[:, token] = True  # a top token tied with masked ones, allowed in every row
    x[first, token] = x.max().item() + 1
    words = bitmask.cpu().to(torch.int64) | (1 << (token % 32)) * torch.nn.functional.one_hot(
        torch.tensor(token // 32), bitmask.shape[1]
    )
    tied = [t for t in range(vocab) if t != token and not bool(allowed[0, t])][:1]
    if tied:
        x[0, tied[0]] = x[0, token]  # a masked token with the same logit
    words = torch.where(words >= 2**31, words - 2**32, words)
    bitmask = words.to(torch.int32).to(DEVICE)
    out = apply(impl, x, bitmask)
    assert_bit_equal(out, reference(x, bitmask))
    assert out.cpu().argmax(dim=-1).tolist() == [token] * batch


# ---------------------------------------------------------------- widths


@pytest.mark.clause("MASK-WIDTH-1")
@given(data=st.data())
def test_masks_across_words_and_vocabulary_blocks(impl, data):
    """Tokens on both sides of 32-bit word boundaries and of the vocabulary blocks of
    chunked kernels (CHUNK_SIZES)."""
    vocab = data.draw(st.integers(max(CHUNK_SIZES) - 40, 2 * max(CHUNK_SIZES) + 40))
    x = make_logits(2, vocab, "normal", data.draw(st.integers(0, 2**32 - 1))).to(DEVICE)
    edges = [32 * k for k in range(1, 4)] + [b * k for b in CHUNK_SIZES for k in (1, 2)]
    words = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int64)
    for edge in edges:
        for t in (edge - 1, edge, edge + 1):
            if t < vocab and data.draw(st.booleans()):
                words[0, t // 32] |= 1 << (t % 32)
    words[1] = words[0] ^ 0xFFFFFFFF  # the complement
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    out = apply(impl, x, bitmask)
    assert_bit_equal(out, reference(x, bitmask))
    assert_bit_equal(out.cpu(), expected(x, bitmask))
    assert bool((torch.isfinite(out[0]) ^ torch.isfinite(out[1])).all())


@pytest.mark.clause("MASK-WIDTH-1")
@given(x=logits(dtypes=FLOATS, masked=False), data=st.data())
def test_padding_bits_of_the_last_word_are_ignored(impl, x, data):
    """Bits past the vocabulary (in the last word and in extra words) change nothing."""
    batch, vocab = x.shape
    need = (vocab + 31) // 32
    extra = data.draw(st.integers(0, 3))
    seed = data.draw(st.integers(0, 2**32 - 1))
    wide = random_bitmask(batch, need + extra, "random", seed)
    words = wide[:, :need].cpu().to(torch.int64) & 0xFFFFFFFF
    if vocab % 32:
        words[:, -1] &= (1 << (vocab % 32)) - 1  # padding bits cleared
    clean = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    out = apply(impl, x, wide)
    assert_bit_equal(out, apply(impl, x, clean))
    assert_bit_equal(out, reference(x, clean))


@pytest.mark.clause("MASK-WIDTH-1")
@given(data=st.data())
def test_columns_past_the_bitmask_are_disallowed(impl, data):
    """Logits wider than the bitmask (an embedding padded past the tokenizer's vocabulary):
    every column past 32 · words is −inf, even with every bit of the bitmask set."""
    batch = data.draw(st.integers(1, MAX_BATCH))
    words = data.draw(st.integers(1, 6))
    vocab = data.draw(st.integers(32 * words + 1, 32 * words + 100))
    x = make_logits(batch, vocab, "normal", data.draw(st.integers(0, 2**32 - 1))).to(DEVICE)
    bitmask = torch.full((batch, words), -1, dtype=torch.int32, device=DEVICE)
    out = apply(impl, x, bitmask).cpu()
    assert_bit_equal(out[:, : 32 * words], x[:, : 32 * words].cpu())
    assert bool((out[:, 32 * words :] == -math.inf).all())


# How an engine's bitmask may be laid out (MASK-WIDTH-1): ceil(V / 32) words, more
# (a vocabulary padded for the model: their bits are ignored), fewer (logits wider
# than the bitmask: the columns past it are disallowed), or a view of a bigger
# buffer whose row stride is not its width. Implementations read each row at the
# bitmask's own strides.
BITMASK_LAYOUTS = (
    "exact",
    "wider by 1",
    "wider by 3",
    "column slice",
    "row slice",
    "broadcast row",
    "column-major",
    "narrower by 1",
    "one word",
)


def laid_out_bitmask(batch: int, vocab: int, layout: str, seed: int) -> torch.Tensor:
    """A random `[batch, words]` int32 bitmask of `[batch, vocab]` logits, laid out as
    `layout` (BITMASK_LAYOUTS); every bit, padding and extra words included, random."""
    need = (vocab + 31) // 32
    if layout == "exact":
        return random_bitmask(batch, need, "random", seed)
    if layout.startswith("wider by "):
        return random_bitmask(batch, need + int(layout.removeprefix("wider by ")), "random", seed)
    if layout == "column slice":  # words 1 .. need + 1 of a buffer need + 4 words wide
        return random_bitmask(batch, need + 4, "random", seed)[:, 1 : need + 2]
    if layout == "row slice":  # every other row of a taller buffer: row stride 2 · need
        return random_bitmask(2 * batch, need, "random", seed)[::2]
    if layout == "broadcast row":  # one grammar for the whole batch: row stride 0
        return random_bitmask(1, need, "random", seed).expand(batch, need)
    if layout == "column-major":  # one word wider; words `batch` apart, rows 1 apart
        return random_bitmask(need + 1, batch, "random", seed).t()
    if layout == "narrower by 1":
        return random_bitmask(batch, max(1, need - 1), "random", seed)
    if layout == "one word":
        return random_bitmask(batch, 1, "random", seed)
    raise ValueError(layout)


@pytest.mark.clause("MASK-WIDTH-1", "MASK-LAYOUT-1")
@pytest.mark.parametrize("layout", BITMASK_LAYOUTS)
def test_a_bitmask_of_any_width_and_strides_is_read_row_by_row(impl, layout):
    """Each row of the bitmask is read at the bitmask's own strides: the result is bit
    for bit the spec's, and that of the same mask copied to ceil(V / 32) contiguous words
    (padding bits cleared, the columns past a narrower bitmask disallowed)."""
    batch, vocab = 3, 70
    x = poisoned(make_logits(batch, vocab, "normal", seed=5).to(DEVICE), seed=6)
    bitmask = laid_out_bitmask(batch, vocab, layout, seed=7)
    out = apply(impl, x, bitmask)
    assert_bit_equal(out, reference(x, bitmask))
    assert_bit_equal(out.cpu(), expected(x, bitmask))
    allowed = allowed_bits(bitmask, vocab).to(torch.int64)
    words = torch.zeros(batch, 32 * ((vocab + 31) // 32), dtype=torch.int64)
    words[:, :vocab] = allowed
    words = (words.view(batch, -1, 32) << torch.arange(32)).sum(-1)
    canonical = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    assert_bit_equal(out, apply(impl, x, canonical))


# ---------------------------------------------------------------- rows


@pytest.mark.clause("MASK-ROWS-1")
@given(x=logits(dtypes=FLOATS), data=st.data())
def test_only_the_indexed_rows_are_masked(impl, x, data):
    """Rows without a mask in the same batch come back bit for bit (NaN included), and their
    bitmask rows, which would disallow everything, are not read."""
    batch = x.shape[0]
    x = poisoned(x, data.draw(st.integers(0, 2**32 - 1)))
    rows = data.draw(st.lists(st.integers(0, batch - 1), max_size=batch + 2))
    indices = torch.tensor(rows, dtype=data.draw(st.sampled_from((torch.int32, torch.int64))))
    bitmask = data.draw(bitmasks(batch, x.shape[1])).clone()
    unmasked = [r for r in range(batch) if r not in rows]
    bitmask[unmasked] = 0
    note(f"indices {rows}")
    out = apply(impl, x, bitmask, indices.to(DEVICE))
    assert_bit_equal(out, reference(x, bitmask, indices.to(DEVICE)))
    assert_bit_equal(out.cpu(), expected(x, bitmask, indices))
    assert_bit_equal(out[unmasked], x[unmasked])


@pytest.mark.clause("MASK-APPLY-1", "MASK-ROWS-1")
@given(x=logits(dtypes=FLOATS), data=st.data())
def test_the_inputs_are_not_modified(impl, x, data):
    bitmask = data.draw(bitmasks(x.shape[0], x.shape[1]))
    indices = torch.arange(x.shape[0], device=DEVICE) if data.draw(st.booleans()) else None
    x_before, mask_before = x.clone(), bitmask.clone()
    out = apply(impl, x, bitmask, indices)
    assert out.data_ptr() != x.data_ptr()
    assert_bit_equal(x, x_before)
    assert torch.equal(bitmask, mask_before)


# ---------------------------------------------------------------- invalid rows


@pytest.mark.clause("MASK-APPLY-1", "MASK-EMPTY-1", "SAMPLE-VALID-1")
@given(x=logits(dtypes=FLOATS), data=st.data())
def test_nan_in_a_disallowed_position_becomes_minus_inf(impl, x, data):
    x = poisoned(x, data.draw(st.integers(0, 2**32 - 1)), fraction=0.5)
    bitmask = data.draw(bitmasks(x.shape[0], x.shape[1]))
    out = apply(impl, x, bitmask)
    allowed = allowed_bits(bitmask, x.shape[1])
    assert bool((out.cpu()[~allowed] == -math.inf).all())
    assert_bit_equal(out.cpu()[allowed], x.cpu()[allowed])  # NaN and +inf stay where allowed
    # The rows SAMPLE-VALID-1 rejects after masking: a NaN or +inf allowed, or nothing finite.
    bad = x.cpu().isnan() | (x.cpu() == math.inf)
    finite = torch.isfinite(x.cpu()) & allowed
    want = (bad & allowed).any(dim=-1) | ~(finite | (bad & allowed)).any(dim=-1)
    assert invalid_rows(out.cpu()).tolist() == want.tolist()


@pytest.mark.clause("MASK-EMPTY-1", "SAMPLE-VALID-1")
@given(x=logits(dtypes=FLOATS), data=st.data())
def test_a_row_with_nothing_allowed_is_all_minus_inf_and_invalid(impl, x, data):
    bitmask = data.draw(bitmasks(x.shape[0], x.shape[1]))
    empty = data.draw(st.integers(0, x.shape[0] - 1))
    bitmask[empty] = 0
    out = apply(impl, x, bitmask)
    assert bool((out[empty] == -math.inf).all())
    assert bool(invalid_rows(out.cpu())[empty])


# ---------------------------------------------------------------- order in the pipeline


@pytest.mark.clause("MASK-ORDER-1")
@given(x=logits(dtypes=(torch.float32,)), data=st.data())
def test_masking_first_leaves_the_filters_an_allowed_token(impl, x, data):
    """Masked before the filters, a row keeps at least one token, and only allowed ones,
    whatever top-k, top-p and min-p do; masked after them it could keep none."""
    batch, vocab = x.shape
    bitmask = random_bitmask(batch, (vocab + 31) // 32, "sparse", data.draw(st.integers(0, 99)))
    words = bitmask.cpu().to(torch.int64)
    for row in range(batch):  # one allowed token with a finite logit in every row
        finite = torch.isfinite(x[row].cpu()).nonzero().flatten().tolist()
        t = finite[data.draw(st.integers(0, len(finite) - 1))]
        words[row, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).to(DEVICE)
    masked = apply(impl, x, bitmask)
    draw = data.draw
    processed = impl.op("process_logits")(
        masked,
        temperature=torch.tensor([draw(st.floats(0.1, 2.0)) for _ in range(batch)]).to(DEVICE),
        top_k=torch.tensor([draw(st.integers(0, 3)) for _ in range(batch)]).to(DEVICE),
        top_p=torch.tensor([draw(st.floats(0.01, 1.0)) for _ in range(batch)]).to(DEVICE),
        min_p=torch.tensor([draw(st.floats(0.0, 1.0)) for _ in range(batch)]).to(DEVICE),
    )
    kept = processed.cpu() > -math.inf
    assert bool(kept.any(dim=-1).all())
    assert not bool((kept & ~allowed_bits(bitmask, vocab)).any())


# ---------------------------------------------------------------- arguments


def _bad_arguments():
    x = torch.zeros(2, 40)
    ok = torch.full((2, 2), -1, dtype=torch.int32)
    return [
        ("logits", TypeError, ([[0.0]], ok, None)),
        ("bitmask", TypeError, (x, [[-1, -1]], None)),
        ("indices", TypeError, (x, ok, [0])),
        ("logits", ValueError, (torch.zeros(2, 40, dtype=torch.int32), ok, None)),
        ("logits", ValueError, (torch.zeros(40), ok, None)),
        ("logits", ValueError, (torch.zeros(2, 0), ok, None)),
        ("bitmask", ValueError, (x, ok.to(torch.int64), None)),
        ("bitmask", ValueError, (x, ok.to(torch.int16), None)),
        ("bitmask", ValueError, (x, ok.to(torch.uint32), None)),
        ("bitmask", ValueError, (x, ok[:, :, None], None)),
        ("bitmask", ValueError, (x, ok[0], None)),
        ("bitmask", ValueError, (x, ok[:1], None)),
        ("bitmask", ValueError, (x, ok[:, :0], None)),
        ("bitmask", ValueError, (x, torch.empty((2, 2), dtype=torch.int32, device="meta"), None)),
        ("indices", ValueError, (x, ok, torch.tensor([2]))),
        ("indices", ValueError, (x, ok, torch.tensor([-1]))),
        ("indices", ValueError, (x, ok, torch.tensor([0, 1, 5], dtype=torch.int32))),
        ("indices", ValueError, (x, ok, torch.tensor([0], dtype=torch.int16))),
        ("indices", ValueError, (x, ok, torch.tensor([[0]]))),
        ("indices", ValueError, (x, ok, torch.tensor([0.0]))),
        ("indices", ValueError, (x, ok, torch.empty(1, dtype=torch.int64, device="meta"))),
    ]


def op_under_test(impl, under: str, name: str):
    """The spec's operation `name` (its own argument checks) or the implementation's.
    The spec's checks run once, in the default run: a peer's column is about the peer."""
    if under == "impl":
        return impl.op(name)
    if impl.explicit:
        pytest.skip("the spec's own argument checks run without --impl")
    return registry.OPERATIONS[name].reference


@pytest.mark.clause("MASK-VALID-1")
@pytest.mark.parametrize(
    ("name", "error", "args"), _bad_arguments(), ids=lambda v: getattr(v, "__name__", None)
)
@pytest.mark.parametrize("under", ["spec", "impl"])
def test_invalid_arguments_are_named(impl, under, name, error, args):
    """Every bad argument is refused, naming it, by the spec itself and by the
    implementation: never an IndexError from deep inside, nor a garbage result."""
    x, bitmask, indices = (
        a.to(DEVICE) if isinstance(a, torch.Tensor) and a.device.type != "meta" else a for a in args
    )
    with pytest.raises(error, match=rf"\b{name}\b"):
        op_under_test(impl, under, "apply_token_bitmask")(x, bitmask, indices)
