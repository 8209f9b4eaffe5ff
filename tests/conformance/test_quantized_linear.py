"""Conformance: the weight-only quantized linear (int4 / int8 group codes).

Every case draws random codes over the whole code range, random positive
scales and random offsets of both signs (never zeros, never constants),
rounds them to the dtypes under test and compares the implementation with
the spec evaluated in float64 on the same codes and rounded values:
‖y − y_ref‖ / ‖y_ref‖ <= the registry's rtol for x's dtype (QUANT-TOL-1).
`dense_weight` decodes the codes an element at a time, straight from the
clauses' text, so that the spec itself is checked when it is the
implementation under test. Shapes cross the kernels' blocks: rows 1 … 33
(GEMV and GEMM), outputs 1 … 70, group sizes 2 … 128, odd ones, ones that do
not divide a power-of-two K-tile (24, 40, 48, 96: groups straddle the tiles)
and one group per row (per-channel). `BRANCH_SHAPES` names shapes for each way a
tiled kernel finds a tile's scales (tests/kernels/test_quant_linear_tiles.py
checks that these shapes, and the strategies, reach each of the Triton
kernel's).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec.spec import registry
from tests.strategies import DEVICE, LARGE

OP = registry.OPERATIONS["quantized_linear"]
FEATURE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
X_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
GROUP_SIZES = (8, 16, 32, 64, 96, 128)
# Not powers of two: groups straddle any power-of-two K-tile, a tile holds several.
ANY_GROUP_SIZES = (2, 3, 6, 24, 40, 48, 96)
if LARGE:  # a GPU run: prefill-sized rows, wider matrices
    MAX_M, MAX_N, MAX_K = 300, 600, 2048
else:
    MAX_M, MAX_N, MAX_K = 33, 70, 256


@dataclass
class Case:
    """One call of quantized_linear, and the integer codes its qweight packs."""

    x: torch.Tensor
    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group_size: int
    bits: int
    codes: torch.Tensor  # [N, K] int64, on the CPU

    @property
    def kwargs(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits}

    def describe(self) -> str:
        m, k = self.x.shape
        return (
            f"x [{m}, {k}] {self.x.dtype}, N {self.codes.shape[0]}, bits {self.bits}, "
            f"group_size {self.group_size}, scales {self.scales.dtype}"
        )


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """QUANT-CODES-1 written out: int8 codes, or two 4-bit codes a byte, even k low."""
    if bits == 8:
        return codes.to(torch.int8)
    low, high = codes[:, 0::2], codes[:, 1::2]
    return (low | (high << 4)).to(torch.uint8)


def make_case(
    m: int,
    n: int,
    k: int,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
    seed: int,
    scale_dtype: torch.dtype = torch.float32,
) -> Case:
    """Random x `[m, k]` in `dtype`, codes over the whole range, scales and offsets per group."""
    g = torch.Generator().manual_seed(seed)
    low, high = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(low, high, (n, k), generator=g)
    groups = k // group_size
    # Scales of a few orders of magnitude, offsets of both signs: a swap shows.
    scales = torch.exp(torch.randn(n, groups, generator=g)) * (0.1 if bits == 4 else 0.01)
    offsets = torch.randn(n, groups, generator=g) * 0.5
    x = torch.randn(m, k, generator=g)
    return Case(
        x=x.to(dtype).to(DEVICE),
        qweight=pack(codes, bits).to(DEVICE),
        scales=scales.to(scale_dtype).to(DEVICE),
        offsets=offsets.to(scale_dtype).to(DEVICE),
        group_size=group_size,
        bits=bits,
        codes=codes,
    )


def max_groups(group_size: int) -> int:
    """The most groups of `group_size` the strategy draws in a row (K at most `MAX_K`)."""
    return max(1, MAX_K // group_size)


def case_shape(bits: int, group_size: int, groups: int, per_channel: bool) -> tuple[int, int]:
    """`(K, group_size)` the strategy makes of its draws: `groups` groups (twice as many
    for an odd K of 4 bits, whose codes pack two a byte), or one group a row."""
    k = group_size * groups
    if bits == 4 and k % 2:
        k *= 2
    return k, k if per_channel else group_size


@st.composite
def cases(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...] = X_DTYPES,
    group_sizes: tuple[int, ...] = GROUP_SIZES,
) -> Case:
    """A random case: shapes across the blocks, any group size of `group_sizes` (or one
    group per row), the scales in float32 or in x's dtype."""
    bits = draw(st.sampled_from((4, 8)))
    group_size = draw(st.sampled_from(group_sizes))
    groups = draw(st.integers(1, max_groups(group_size)))
    k, group_size = case_shape(bits, group_size, groups, per_channel=draw(st.booleans()))
    m = draw(st.integers(1, MAX_M))
    n = draw(st.integers(1, MAX_N))
    dtype = draw(st.sampled_from(dtypes))
    # float64 x takes float64 scales: the spec evaluates W in the scales' precision
    # (QUANT-GROUP-1), and float32 weights are not within float64's rtol of the reference.
    scale_dtype = dtype if dtype == torch.float64 else draw(st.sampled_from((torch.float32, dtype)))
    seed = draw(st.integers(0, 2**32 - 1))
    return make_case(m, n, k, group_size, bits, dtype, seed, scale_dtype)


def call(impl, case: Case) -> torch.Tensor:
    """The implementation's quantized_linear on `case`, with the feature its dtype needs."""
    if case.x.dtype in FEATURE:
        impl.require(FEATURE[case.x.dtype])
    return impl.op("quantized_linear")(
        case.x, case.qweight, case.scales, case.offsets, **case.kwargs
    )


def reference(case: Case) -> torch.Tensor:
    """The spec in float64 on the same codes and rounded values."""
    return OP.reference(
        case.x.double(), case.qweight, case.scales.double(), case.offsets.double(), **case.kwargs
    )


def dense_weight(case: Case) -> torch.Tensor:
    """QUANT-GROUP-1 and QUANT-CODES-1 written out, float64 `[N, K]` on the CPU: the codes
    unpacked a byte at a time, each element's group `k // G`."""
    q = case.qweight.cpu().to(torch.int64)
    if case.bits == 4:
        k = torch.arange(2 * q.shape[1])
        codes = (q[:, k // 2] >> (4 * (k % 2))) & 0xF
    else:
        codes = q
    group = torch.arange(codes.shape[1]) // case.group_size
    s = case.scales.cpu().double()[:, group]
    o = case.offsets.cpu().double()[:, group]
    return s * codes.double() + o


def relative_error(out: torch.Tensor, want: torch.Tensor, terms: torch.Tensor, k: int) -> float:
    """‖out − want‖ / ‖want‖, the denominator at least ‖terms‖ / √K (`terms` = |x| · |W|ᵀ):
    a float32 sum's rounding is relative to its terms, so outputs whose terms cancel (one
    output of 1e-3 from terms of 1) are measured on the scale of their terms. The spec
    itself, evaluated in float32, fails such cases without the floor; random outputs have
    ‖want‖ of that order, so the floor changes nothing else."""
    out, want = out.cpu().double(), want.cpu().double()
    scale = max(want.norm().item(), terms.norm().item() / max(k, 1) ** 0.5)
    return ((out - want).norm() / scale).item()


def assert_matches(out: torch.Tensor, case: Case) -> None:
    """Shape, dtype and device of QUANT-LINEAR-1; values within QUANT-TOL-1 of the spec in
    float64 and of the written-out definition."""
    m, n = case.x.shape[0], case.codes.shape[0]
    assert out.shape == (m, n), (out.shape, (m, n))
    assert out.dtype == case.x.dtype, (out.dtype, case.x.dtype)
    assert out.device == case.x.device, (out.device, case.x.device)
    assert bool(torch.isfinite(out).all()), "non-finite outputs"
    rtol = OP.tolerance.rtol[case.x.dtype]
    x, weight = case.x.cpu().double(), dense_weight(case)
    terms, k = x.abs() @ weight.abs().T, x.shape[1]
    error = relative_error(out, reference(case), terms, k)
    assert error <= rtol, f"relative error {error:.3g} > {rtol:g} against the spec in float64"
    error = relative_error(out, x @ weight.T, terms, k)
    assert error <= rtol, f"relative error {error:.3g} > {rtol:g} against the clauses"


# ---------------------------------------------------------------- values


@pytest.mark.clause("QUANT-LINEAR-1", "QUANT-TOL-1")
@given(case=cases())
def test_matches_the_definition_in_float64(impl, case):
    note(case.describe())
    x_before = case.x.clone()
    out = call(impl, case)
    assert_matches(out, case)
    assert torch.equal(case.x, x_before), "x was modified"


@pytest.mark.clause("QUANT-GROUP-1", "QUANT-TOL-1")
@given(case=cases(dtypes=(torch.float32,), group_sizes=ANY_GROUP_SIZES))
def test_groups_of_any_size_that_divides_k(impl, case):
    """Group sizes that are not powers of two: groups straddle the kernels' K-tiles."""
    note(case.describe())
    assert_matches(call(impl, case), case)


# (K, group_size): a tiled kernel's K-tile (16 … 128 elements, a power of two) lies
# inside one group (a group over one or two tiles), holds several whole groups (the
# last ones past K in a tile of 128), or meets groups that straddle the tiles (96 and
# 48 over tiles of 64 or 128, 12 in a tile of 32 that passes K).
BRANCH_SHAPES = ((256, 128), (192, 64), (192, 16), (96, 32), (192, 96), (144, 48), (24, 12))
BRANCH_ROWS = (1, 5, 16)  # a decode row (K split), a few rows, a 16-row prefill (GEMM)
BRANCH_N = 33


@pytest.mark.clause("QUANT-GROUP-1", "QUANT-TOL-1")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", BRANCH_ROWS)
@pytest.mark.parametrize(("k", "group_size"), BRANCH_SHAPES)
def test_groups_against_the_k_tiles(impl, k, group_size, m, bits):
    """Every way a group can meet a K-tile, for decode and prefill rows: each element's
    scale and offset is its own group's wherever the tile and split boundaries fall."""
    seed = k + group_size + m + bits
    case = make_case(m, BRANCH_N, k, group_size, bits, torch.float32, seed=seed)
    assert_matches(call(impl, case), case)


@pytest.mark.clause("QUANT-GROUP-1")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 5, 256), (3, 70, 64), (20, 9, 128)])
def test_per_channel_is_one_group_per_row(impl, bits, m, n, k):
    """`group_size == K`: one scale and one offset a row."""
    case = make_case(m, n, k, k, bits, torch.float32, seed=m * n + k + bits)
    assert case.scales.shape == (n, 1)
    assert_matches(call(impl, case), case)


@pytest.mark.clause("QUANT-GROUP-1")
@pytest.mark.parametrize("bits", [4, 8])
def test_each_group_has_its_own_scale_and_offset(impl, bits):
    """Changing one group's scale and offset changes exactly that group's products:
    the output column of its row, by `x[:, group] · (Δs · q + Δo)`."""
    m, n, k, group_size = 9, 6, 96, 16
    case = make_case(m, n, k, group_size, bits, torch.float32, seed=bits)
    before = call(impl, case).cpu().double()
    row, group = 4, 3
    scales, offsets = case.scales.clone(), case.offsets.clone()
    scales[row, group] *= 3.0
    offsets[row, group] -= 2.0
    changed = Case(case.x, case.qweight, scales, offsets, group_size, bits, case.codes)
    after = call(impl, changed).cpu().double()
    span = slice(group * group_size, (group + 1) * group_size)
    delta_w = (
        2.0 * case.scales[row, group].item() * case.codes[row, span].double() - 2.0
    )  # Δs · q + Δo
    want = case.x.cpu().double()[:, span] @ delta_w
    others = [c for c in range(n) if c != row]
    assert torch.equal(after[:, others], before[:, others]), "other rows' outputs changed"
    scale = (case.x.cpu().double().abs() @ dense_weight(changed).abs().T).max().item()
    assert torch.allclose(after[:, row] - before[:, row], want, rtol=0, atol=1e-5 * scale)
    assert_matches(call(impl, changed), changed)


# ---------------------------------------------------------------- codes


@pytest.mark.clause("QUANT-CODES-1")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", ["all", "one"])
def test_identity_rows_read_back_every_weight(impl, bits, rows):
    """x = rows of the identity: the output is the dequantized weight, element by element,
    exactly (a product with 1, sums of zeros). Swapped nibbles, or int8 codes read as
    unsigned, move or change values. `s · q + o` may be rounded once, as a fused
    multiply-add (what Triton compiles it to on a GPU), or twice, as the spec's float32
    evaluation does (QUANT-TOL-1 admits either); any other value is a misread code."""
    n, k, group_size = 37, 32, 8
    case = make_case(1, n, k, group_size, bits, torch.float32, seed=bits)
    # Every code value appears, both extremes included.
    low, high = (0, 15) if bits == 4 else (-128, 127)
    codes = case.codes.clone()
    codes.view(-1)[: high - low + 1] = torch.arange(low, high + 1)
    eye = torch.eye(k, dtype=torch.float32)
    x = eye if rows == "all" else eye[5:6]
    case = Case(
        x.to(DEVICE), pack(codes, bits).to(DEVICE), case.scales, case.offsets,
        group_size, bits, codes,
    )  # fmt: skip
    out = call(impl, case).cpu()
    scales = case.scales.cpu()[:, torch.arange(k) // group_size]
    offsets = case.offsets.cpu()[:, torch.arange(k) // group_size]
    weight = scales * codes.float() + offsets  # float32, as the spec evaluates it
    # One rounding: s · q is exact in float64 (24 + 8 bits), the sum too at these sizes.
    fused = (scales.double() * codes.double() + offsets.double()).float()
    rows_of = (lambda w: w.T) if rows == "all" else (lambda w: w.T[5:6])
    want, want_fused = rows_of(weight), rows_of(fused)
    bad = (out != want) & (out != want_fused)
    assert not bool(bad.any()), f"differs at (row, column) {bad.nonzero().tolist()[:8]}"


@pytest.mark.clause("QUANT-CODES-1")
def test_low_nibble_is_the_even_element(impl):
    """One byte per row, codes (a, b) with a != b: element 0 is the low nibble."""
    codes = torch.tensor([[3, 12], [15, 0], [1, 14], [9, 6]])
    qweight = pack(codes, 4)
    assert qweight.tolist() == [[0xC3], [0x0F], [0xE1], [0x69]]
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, -1.0]])
    scales = torch.tensor([[0.5], [1.5], [-0.25], [2.0]])
    offsets = torch.tensor([[-1.0], [0.25], [3.0], [-7.0]])
    case = Case(
        x.to(DEVICE), qweight.to(DEVICE), scales.to(DEVICE), offsets.to(DEVICE), 2, 4, codes
    )
    out = call(impl, case).cpu()
    weight = scales * codes.float() + offsets
    assert torch.equal(out, x @ weight.T), (out.tolist(), (x @ weight.T).tolist())


# ---------------------------------------------------------------- shapes and layouts


@pytest.mark.clause("QUANT-LINEAR-1", "QUANT-TOL-1")
@pytest.mark.parametrize(
    ("m", "n", "k", "group_size"),
    [(1, 65, 256, 32), (7, 1, 128, 128), (8, 64, 64, 8), (17, 70, 192, 64), (33, 33, 256, 16)],
)
@pytest.mark.parametrize("bits", [4, 8])
def test_shapes_across_the_blocks(impl, m, n, k, group_size, bits):
    """Rows and outputs around 1, 8, 16, 32 and 64: partial tiles in every dimension."""
    case = make_case(m, n, k, group_size, bits, torch.float32, seed=m + n + k + bits)
    assert_matches(call(impl, case), case)


@pytest.mark.clause("QUANT-LINEAR-1")
@pytest.mark.parametrize("bits", [4, 8])
def test_strided_arguments(impl, bits):
    """x a transposed view, qweight, scales and offsets column slices of wider tensors."""
    m, n, k, group_size = 5, 11, 64, 16
    case = make_case(m, n, k, group_size, bits, torch.float32, seed=7)
    x = case.x.T.contiguous().T  # column-major
    wide_q = torch.cat([case.qweight, case.qweight[:, :3]], dim=1)
    wide_s = torch.cat([case.scales, case.scales], dim=1)
    wide_o = torch.cat([case.offsets, case.offsets], dim=1)
    strided = Case(
        x, wide_q[:, : case.qweight.shape[1]], wide_s[:, : k // group_size],
        wide_o[:, : k // group_size], group_size, bits, case.codes,
    )  # fmt: skip
    assert not strided.x.is_contiguous() and not strided.qweight.is_contiguous()
    assert_matches(call(impl, strided), case)


@pytest.mark.clause("QUANT-LINEAR-1")
@pytest.mark.parametrize("bits", [4, 8])
def test_no_rows(impl, bits):
    case = make_case(1, 6, 32, 16, bits, torch.float32, seed=1)
    case.x = case.x[:0]
    out = call(impl, case)
    assert out.shape == (0, 6) and out.dtype == torch.float32


# ---------------------------------------------------------------- validation


def _bad_arguments() -> list:
    """(argument named in the error, error type, change to a valid call)."""

    def good() -> dict:
        case = make_case(2, 3, 16, 8, 4, torch.float32, seed=0)
        return {
            "x": case.x, "qweight": case.qweight, "scales": case.scales,
            "offsets": case.offsets, "group_size": 8, "bits": 4,
        }  # fmt: skip

    def changed(**values) -> dict:
        return values

    meta = torch.device("meta")
    return [
        ("x", TypeError, changed(x=[[1.0] * 16] * 2)),
        ("qweight", TypeError, changed(qweight=None)),
        ("scales", TypeError, changed(scales=1.0)),
        ("offsets", TypeError, changed(offsets="0")),
        ("bits", ValueError, changed(bits=3)),
        ("bits", ValueError, changed(bits=16)),
        ("group_size", ValueError, changed(group_size=0)),
        ("group_size", ValueError, changed(group_size=-8)),
        ("group_size", ValueError, changed(group_size=8.0)),
        ("group_size", ValueError, changed(group_size=5)),  # 16 is not a multiple of 5
        ("qweight", ValueError, changed(bits=8)),  # uint8 codes for 8 bits
        ("qweight", ValueError, changed(qweight=torch.zeros(3, 8, dtype=torch.int8))),
        ("qweight", ValueError, changed(qweight=torch.zeros(24, dtype=torch.uint8))),
        ("qweight", ValueError, changed(qweight=torch.zeros(3, 8, dtype=torch.int32))),
        ("scales", ValueError, changed(scales=torch.ones(3, 3))),
        ("scales", ValueError, changed(scales=torch.ones(2, 2))),
        ("scales", ValueError, changed(scales=torch.ones(3, 2, dtype=torch.int32))),
        ("offsets", ValueError, changed(offsets=torch.ones(3, 1))),
        ("offsets", ValueError, changed(offsets=torch.ones(6))),
        ("offsets", ValueError, changed(offsets=torch.ones(3, 2, dtype=torch.int64))),
        ("x", ValueError, changed(x=torch.ones(2, 15))),
        ("x", ValueError, changed(x=torch.ones(16))),
        ("x", ValueError, changed(x=torch.ones(2, 16, dtype=torch.int32))),
        ("x", ValueError, changed(x=torch.ones(2, 16, device=meta))),
        ("scales", ValueError, changed(scales=torch.ones(3, 2, device=meta))),
        ("offsets", ValueError, changed(offsets=torch.ones(3, 2, device=meta))),
    ], good


BAD_ARGUMENTS, GOOD_ARGUMENTS = _bad_arguments()


@pytest.mark.clause("QUANT-VALID-1")
@pytest.mark.parametrize(
    ("name", "error", "change"),
    BAD_ARGUMENTS,
    ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(BAD_ARGUMENTS)],
)
def test_invalid_arguments_are_named(impl, name, error, change):
    arguments = GOOD_ARGUMENTS()
    for key, value in change.items():
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            value = value.to(DEVICE)
        arguments[key] = value
    x, qweight, scales, offsets = (arguments.pop(k) for k in ("x", "qweight", "scales", "offsets"))
    with pytest.raises(error, match=rf"\b{name}\b"):
        impl.op("quantized_linear")(x, qweight, scales, offsets, **arguments)


@pytest.mark.clause("QUANT-VALID-1")
def test_a_valid_call_passes_the_checks(impl):
    """The template the invalid calls change is itself valid."""
    arguments = GOOD_ARGUMENTS()
    out = impl.op("quantized_linear")(
        arguments.pop("x"), arguments.pop("qweight"), arguments.pop("scales"),
        arguments.pop("offsets"), **arguments,
    )  # fmt: skip
    assert out.shape == (2, 3)
