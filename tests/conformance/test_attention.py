"""Conformance: attention over a paged KV cache (appending to the cache:
tests/conformance/test_append_kv.py).

Every case is built the way an engine builds it: each sequence's keys and
values are drawn contiguous, rounded to the dtype under test, and scattered
into NaN-filled caches through a shuffled block table whose unused tail holds
garbage, so a read of any slot past a sequence's end, or of an unused table
entry, shows. Outputs are compared with the spec evaluated in float64 on the
same rounded inputs, row by row (one query token, all heads):
‖out − ref‖ / ‖ref‖ <= the registry's rtol for the input dtype.
`dense_attention` is an independent reference built straight from
SEMANTICS.md ("Attention with a KV cache") on the contiguous copies;
tests/spec/test_attention_spec.py uses it to cross-check the spec itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec.spec import registry
from tests.strategies import DEVICE, FLOAT_DTYPES, LARGE, THOROUGH

ATTENTION = registry.OPERATIONS["paged_attention"]

# Sizes: the kernels run in the Triton interpreter without a GPU, so keep the
# work of an example small there; a GPU run draws batches an engine serves.
if LARGE:
    MAX_SEQS, MAX_SEQ_LEN, MAX_Q_LEN, MAX_KV_HEADS = 8, 600, 32, 4
    BLOCK_SIZES = (1, 3, 16, 32, 64)
    LONG_SEQ_LEN = 4100
else:
    MAX_SEQS, MAX_SEQ_LEN, MAX_Q_LEN, MAX_KV_HEADS = 3, 40, 8, 2
    BLOCK_SIZES = (1, 2, 3, 16)
    LONG_SEQ_LEN = 300
GROUPS = (1, 2, 3, 4, 8)  # num_q_heads // num_kv_heads
HEAD_DIMS = (64, 80, 96, 128, 256)
INDEX_DTYPES = (torch.int32, torch.int64)
FEATURE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}


def require_dtype(impl, dtype: torch.dtype) -> None:
    if dtype in FEATURE:
        impl.require(FEATURE[dtype])


# ---------------------------------------------------------------- building cases


@dataclass
class Case:
    """One call of paged_attention, and the contiguous data it was built from."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    scale: float | None = None

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.query_start,
        )

    def float64_args(self) -> tuple[torch.Tensor, ...]:
        """The same call on the same rounded values, in float64 (NaN poison stays NaN)."""
        q, k, v, *rest = self.args
        return (q.double(), k.double(), v.double(), *rest)


def build_case(
    shapes: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    spread: float = 1.0,
    spare_blocks: int = 2,
    extra_columns: int = 1,
    index_dtype: torch.dtype = torch.int32,
    scale: float | None = None,
    layout_seed: int | None = None,
) -> Case:
    """A batch of sequences `(seq_len, q_len)` in a shuffled, NaN-poisoned paged cache.

    Keys and values are standard normal, queries normal times `spread` (small:
    a flat softmax, large: a peaked one). Blocks are handed out in a random
    order (block tables are not the identity); `spare_blocks` blocks belong
    to nobody; table entries past a sequence's used blocks hold garbage
    (−1, valid ids of NaN blocks, or ids past the end). The values depend on
    `seed` only, the layout on `layout_seed` (default `seed + 1`) and the
    block size.
    """
    g = torch.Generator().manual_seed(seed)
    layout = torch.Generator().manual_seed(seed + 1 if layout_seed is None else layout_seed)
    used = [-(-n // block_size) for n, _ in shapes]
    num_blocks = sum(used) + spare_blocks
    order = torch.randperm(num_blocks, generator=layout)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    v_cache = torch.full(cache_shape, math.nan, dtype=dtype)
    max_blocks = max(used, default=0) + extra_columns
    block_table = torch.randint(-1, num_blocks + 5, (len(shapes), max_blocks), generator=layout)
    keys, values, starts = [], [], [0]
    taken = 0
    for b, (seq_len, q_len) in enumerate(shapes):
        blocks = order[taken : taken + used[b]]
        taken += used[b]
        block_table[b, : used[b]] = blocks
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        position = torch.arange(seq_len)
        k_cache[blocks[position // block_size], position % block_size] = k
        v_cache[blocks[position // block_size], position % block_size] = v
        keys.append(k.to(DEVICE))
        values.append(v.to(DEVICE))
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=g) * spread
    return Case(
        q=q.to(dtype).to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        block_table=block_table.to(index_dtype).to(DEVICE),
        seq_lens=torch.tensor([n for n, _ in shapes], dtype=index_dtype, device=DEVICE),
        query_start=torch.tensor(starts, dtype=index_dtype, device=DEVICE),
        keys=keys,
        values=values,
        scale=scale,
    )


SEQUENCE_KINDS = ("decode", "decode", "chunk", "prefill", "idle", "empty", "padding")
KEYLESS = ("empty", "padding")  # sequences without keys (ATTN-EMPTY-1)


@st.composite
def sequence_shapes(draw: st.DrawFn, kinds: tuple[str, ...] = SEQUENCE_KINDS) -> tuple[int, int]:
    """(seq_len, q_len) of one sequence in a step."""
    kind = draw(st.sampled_from(kinds))
    if kind == "decode":
        return draw(st.integers(1, MAX_SEQ_LEN)), 1
    if kind == "chunk":  # chunked prefill or speculative verification
        seq_len = draw(st.integers(2, MAX_SEQ_LEN))
        return seq_len, draw(st.integers(2, min(seq_len, MAX_Q_LEN)))
    if kind == "prefill":  # the first chunk of a prompt: q_len == seq_len
        seq_len = draw(st.integers(1, MAX_Q_LEN))
        return seq_len, seq_len
    if kind == "idle":  # a sequence with no new token in this step
        return draw(st.integers(1, MAX_SEQ_LEN)), 0
    if kind == "empty":
        return 0, 0
    return 0, draw(st.integers(1, 3))  # padding rows: no keys (ATTN-EMPTY-1)


@st.composite
def attention_cases(draw: st.DrawFn, dtype: torch.dtype, keyless: bool = True) -> Case:
    """A batch mixing decode, chunks, prefills, idle, empty and padding sequences.

    `keyless=False` leaves out the sequences without keys (empty, padding).

    Scores stay within about ±30 (query spread times scale factor at most
    6 standard deviations): a float32 score of magnitude S is only known to
    about S·2^-24, and the float32 tolerance of 1e-5 assumes moderate S.
    test_scores_of_large_magnitude_do_not_overflow covers large ones.
    """
    kinds = SEQUENCE_KINDS if keyless else tuple(k for k in SEQUENCE_KINDS if k not in KEYLESS)
    shapes = draw(st.lists(sequence_shapes(kinds), min_size=1, max_size=MAX_SEQS))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    # None (the default 1/sqrt(head_dim)) or a given scale, as a factor of the default
    factor = draw(st.one_of(st.none(), st.sampled_from((0.5, 2.0)), st.floats(0.05, 2.0)))
    return build_case(
        shapes,
        num_kv_heads=draw(st.integers(1, MAX_KV_HEADS)),
        group=draw(st.sampled_from(GROUPS)),
        head_dim=head_dim,
        block_size=draw(st.sampled_from(BLOCK_SIZES)),
        dtype=dtype,
        seed=draw(st.integers(0, 2**32 - 1)),
        spread=draw(st.sampled_from((0.3, 1.0, 3.0))),
        spare_blocks=draw(st.integers(0, 3)),
        extra_columns=draw(st.integers(0, 2)),
        index_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        scale=None if factor is None else factor / math.sqrt(head_dim),
    )


# ---------------------------------------------------------------- references


def dense_attention(case: Case, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SEMANTICS.md, "Attention with a KV cache", evaluated in float64 on contiguous keys.

    No cache, no block table, no mask: query row r of sequence b sits at
    position p = seq_len − q_len + r and takes `softmax(scale · K[:p+1] q) ·
    V[:p+1]` over the first p + 1 keys of its own sequence, head h reading
    KV head h // (num_q_heads / num_kv_heads). Rows without keys give zeros
    and log-sum-exp −inf.
    """
    num_tokens, num_q_heads, head_dim = case.q.shape
    scale = case.scale if scale is None else scale
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64)
    starts = case.query_start.tolist()
    q = case.q.double().cpu()
    for b, seq_len in enumerate(case.seq_lens.tolist()):
        keys, values = case.keys[b].double().cpu(), case.values[b].double().cpu()
        group = num_q_heads // keys.shape[1]
        q_len = starts[b + 1] - starts[b]
        for r in range(q_len if seq_len > 0 else 0):
            p = seq_len - q_len + r
            t = starts[b] + r
            for h in range(num_q_heads):
                k, v = keys[: p + 1, h // group], values[: p + 1, h // group]
                scores = scale * (k @ q[t, h])
                out[t, h] = torch.softmax(scores, dim=0) @ v
                lse[t, h] = torch.logsumexp(scores, dim=0)
    return out, lse


def spec_attention(case: Case, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec in float64 on the case's rounded inputs: (out, lse)."""
    kwargs.setdefault("scale", case.scale)
    return ATTENTION.reference(*case.float64_args(), return_lse=True, **kwargs)


def poison_allocator(*shapes: tuple[int, ...], dtype: torch.dtype) -> None:
    """Hand freshly NaN-filled memory to the next allocations of these sizes.

    An operation allocates its own output; freeing NaN-filled blocks of the
    same sizes first makes the caching allocator reuse them, so a row the
    implementation forgets to write shows as NaN instead of a lucky zero.
    """
    poison = [torch.full(shape, math.nan, dtype=dtype, device=DEVICE) for shape in shapes]
    del poison


def call_attention(impl, case: Case, return_lse: bool = True, **kwargs):
    """The implementation's attention on `case`: `out`, or `(out, lse)` with return_lse.

    An implementation that declares the `lse` feature unsupported is called
    without it and returns `(out, None)`: the tests that read the lse along
    the way still check its output, and ATTN-LSE-1's own test skips.
    """
    num_tokens, num_q_heads, head_dim = case.q.shape
    poison_allocator((num_tokens, num_q_heads, head_dim), dtype=case.q.dtype)
    poison_allocator((num_tokens, num_q_heads), dtype=torch.float32)
    kwargs.setdefault("scale", case.scale)
    if return_lse and not impl.supports("lse"):
        return impl.op("paged_attention")(*case.args, return_lse=False, **kwargs), None
    return impl.op("paged_attention")(*case.args, return_lse=return_lse, **kwargs)


def assert_rows_close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rtol: float | None = None
) -> None:
    """Per query row (all heads): ‖out − ref‖ <= rtol · ‖ref‖; rows of zeros exactly."""
    rtol = ATTENTION.tolerance.rtol[dtype] if rtol is None else rtol
    assert out.shape == ref.shape, (out.shape, ref.shape)
    out, ref = out.double().cpu(), ref.double().cpu()
    assert bool(torch.isfinite(out).all()), (
        f"non-finite output in rows {(~torch.isfinite(out)).flatten(1).any(1).nonzero().flatten()}"
        " (a read past a sequence's end, or a row left unwritten?)"
    )
    error = (out - ref).flatten(1).norm(dim=1)
    size = ref.flatten(1).norm(dim=1)
    bad = error > rtol * size
    assert not bool(bad.any()), (
        f"rows {bad.nonzero().flatten().tolist()}: relative error "
        f"{(error[bad] / size[bad]).tolist()} > {rtol:g}"
    )


def assert_lse_close(lse: torch.Tensor | None, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """−inf where the reference is −inf; elsewhere |lse − ref| <= rtol · max(1, |ref|).

    lse is a logarithm: an absolute error in it is a relative error in the
    normaliser exp(lse), the quantity the tolerance is about. None (an
    implementation without the `lse` feature) checks nothing.
    """
    if lse is None:
        return
    rtol = ATTENTION.tolerance.rtol[dtype]
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert lse.shape == ref.shape, (lse.shape, ref.shape)
    empty = ref == -math.inf
    assert bool((lse[empty] == -math.inf).all()), "rows without keys must have lse −inf"
    assert bool(torch.isfinite(lse[~empty]).all()), "non-finite lse where keys exist"
    error = (lse - ref)[~empty].abs()
    bound = rtol * ref[~empty].abs().clamp(min=1)
    assert bool((error <= bound).all()), f"lse error {error.max().item():.3g} beyond {rtol:g}"


def assert_matches_spec(impl, case: Case, dtype: torch.dtype) -> None:
    """The implementation's output and log-sum-exp on `case` equal the spec's (float64)
    within the tolerance of `dtype`."""
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = spec_attention(case)
    assert_rows_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)


# ---------------------------------------------------------------- paged_attention


@pytest.mark.clause(
    "ATTN-LAYOUT-1",
    "ATTN-PACK-1",
    "ATTN-CAUSAL-1",
    "ATTN-SCALE-1",
    "ATTN-GQA-1",
    "ATTN-DTYPE-1",
    "ATTN-EMPTY-1",
    "ATTN-BOUNDS-1",
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@given(data=st.data())
def test_paged_attention_matches_spec(impl, dtype, data):
    require_dtype(impl, dtype)
    case = data.draw(attention_cases(dtype))
    return_lse = data.draw(st.booleans())
    note(f"seq_lens={case.seq_lens.tolist()} query_start={case.query_start.tolist()}")
    result = call_attention(impl, case, return_lse=return_lse)
    ref_out, ref_lse = spec_attention(case)
    if return_lse:
        assert isinstance(result, tuple) and len(result) == 2
        out, lse = result
        assert lse is None or lse.dtype == torch.float32
        assert_lse_close(lse, ref_lse, dtype)
    else:
        assert isinstance(result, torch.Tensor)
        out = result
    assert out.dtype == dtype
    assert_rows_close(out, ref_out, dtype)


@pytest.mark.clause("ATTN-LSE-1")
@pytest.mark.parametrize("dtype", (*FLOAT_DTYPES, torch.float64), ids=str)
@given(data=st.data())
def test_log_sum_exp_matches_spec(impl, dtype, data):
    # Rows without keys (lse −inf) are ATTN-EMPTY-1's, checked by its own tests.
    impl.require("lse")
    require_dtype(impl, dtype)
    case = data.draw(attention_cases(dtype, keyless=False))
    result = impl.op("paged_attention")(*case.args, scale=case.scale, return_lse=True)
    assert isinstance(result, tuple) and len(result) == 2
    _, lse = result
    num_tokens, num_q_heads, _ = case.q.shape
    assert lse.shape == (num_tokens, num_q_heads) and lse.device == case.q.device
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_lse_close(lse, spec_attention(case)[1], dtype)


@pytest.mark.clause("ATTN-DTYPE-1")
@given(data=st.data())
def test_float64_inputs_compute_in_float64(impl, data):
    impl.require("float64")
    case = data.draw(attention_cases(torch.float64))
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = spec_attention(case)
    assert out.dtype == torch.float64 and (lse is None or lse.dtype == torch.float64)
    assert_rows_close(out, ref_out, torch.float64)
    assert_lse_close(lse, ref_lse, torch.float64)


@pytest.mark.clause("ATTN-DTYPE-1")
@pytest.mark.boundary("many-kv-tiles")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_accumulates_in_float32(impl, dtype):
    """A running sum that grows large and cancels: only a float32 accumulator survives it.

    Near-equal weights (a tiny scale) over 1024 values: +32 plus a small
    signal for the first half of the positions, −32 plus the signal for the
    second. The unnormalised sum climbs past 16384, where float16 steps by 16
    and bfloat16 by 128, then cancels back to the signal: an accumulator kept
    in the input dtype (between tiles, say) leaves errors of the order of its
    steps, far beyond the tolerance; a float32 one does not.
    """
    require_dtype(impl, dtype)
    seq_len = 1024
    case = build_case(
        [(seq_len, 1)], num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=dtype, seed=7
    )
    position = torch.arange(seq_len, dtype=torch.float64)[:, None, None]
    offset = torch.where(position < seq_len // 2, 32.0, -32.0)
    signal = 1 + position / seq_len + torch.linspace(0, 0.5, 64, dtype=torch.float64)
    case.values[0][:] = (offset + signal).to(dtype).to(DEVICE)
    position = torch.arange(seq_len, device=DEVICE)
    blocks = case.block_table[0].long()[position // 16]
    case.v_cache[blocks, position % 16] = case.values[0]
    out, lse = call_attention(impl, case, scale=1e-6)
    ref_out, ref_lse = spec_attention(case, scale=1e-6)
    assert_rows_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.clause("ATTN-DTYPE-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("return_lse", [False, True])
def test_output_shapes_and_dtypes(impl, dtype, return_lse):
    require_dtype(impl, dtype)
    case = build_case(
        [(5, 2), (3, 1)], num_kv_heads=2, group=3, head_dim=64, block_size=2, dtype=dtype, seed=1
    )
    result = call_attention(impl, case, return_lse=return_lse)
    out = result[0] if return_lse else result
    assert isinstance(out, torch.Tensor)
    assert out.shape == (3, 6, 64) and out.dtype == dtype and out.device == case.q.device
    if return_lse and result[1] is not None:
        assert result[1].shape == (3, 6) and result[1].dtype == torch.float32


@pytest.mark.clause("ATTN-SCALE-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_scores_of_large_magnitude_do_not_overflow(impl, dtype):
    """Scores near 180: exp without subtracting the maximum overflows float32 (and float16).

    A float32 score of magnitude S is itself only known to about S·2^-24 per
    rounding, so the comparison allows S·2^-20 on top of the dtype's rtol: it
    is about overflow and stability, not about the last bits.
    """
    require_dtype(impl, dtype)
    case = build_case(
        [(37, 3), (20, 1)],
        num_kv_heads=2,
        group=2,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        seed=3,
        spread=1.0,
    )
    # Every key gets a large shared component along the queries' common direction.
    shift = torch.full((128,), 4.0, device=DEVICE)
    case.q[:] = (case.q.float() + shift).to(dtype)
    for b, keys in enumerate(case.keys):
        keys[:] = (keys.float() + shift).to(dtype)
        position = torch.arange(keys.shape[0], device=DEVICE)
        blocks = case.block_table[b].long()[position // 16]
        case.k_cache[blocks, position % 16] = keys
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = spec_attention(case)
    largest = ref_lse.max().item()
    assert ref_lse.min().item() > 100, "the case must have large scores"
    rtol = ATTENTION.tolerance.rtol[dtype] + largest * 2.0**-20
    assert_rows_close(out, ref_out, dtype, rtol=rtol)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.clause("ATTN-SCALE-1")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_default_scale_is_inverse_sqrt_head_dim(impl, head_dim):
    shapes = [(9, 2), (4, 1)]
    case = build_case(
        shapes,
        num_kv_heads=1,
        group=2,
        head_dim=head_dim,
        block_size=3,
        dtype=torch.float32,
        seed=head_dim,
        spread=3.0,
    )
    out, lse = call_attention(impl, case, scale=None)
    ref_out, ref_lse = dense_attention(case, scale=1 / math.sqrt(head_dim))
    assert_rows_close(out, ref_out, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)
    # and a given scale is used as is
    out, lse = call_attention(impl, case, scale=0.1)
    ref_out, ref_lse = dense_attention(case, scale=0.1)
    assert_rows_close(out, ref_out, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.clause("ATTN-GQA-1")
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads"), [(9, 3), (8, 1), (6, 2), (4, 4), (12, 4), (16, 2)]
)
def test_grouped_query_heads_read_their_kv_head(impl, num_q_heads, num_kv_heads):
    """Grouped attention equals multi-head attention over caches with each KV head repeated."""
    group = num_q_heads // num_kv_heads
    case = build_case(
        [(11, 3), (6, 1)],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        block_size=4,
        dtype=torch.float32,
        seed=num_q_heads * 31 + num_kv_heads,
        spread=4.0,
    )
    out, lse = call_attention(impl, case)
    expanded = {
        "k_cache": case.k_cache.repeat_interleave(group, dim=2),
        "v_cache": case.v_cache.repeat_interleave(group, dim=2),
    }
    mha = Case(**{**case.__dict__, **expanded})
    mha_out, mha_lse = call_attention(impl, mha)
    assert_rows_close(out, mha_out.double(), torch.float32)
    if lse is not None:
        assert_lse_close(lse, mha_lse.double(), torch.float32)
    ref_out, _ = dense_attention(case)
    assert_rows_close(out, ref_out, torch.float32)


@pytest.mark.clause("ATTN-EMPTY-1", "ATTN-PACK-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_sequences_without_keys_give_zeros_and_minus_inf(impl, dtype):
    require_dtype(impl, dtype)
    # an empty sequence, a padding sequence with 3 rows, an idle sequence, a decode
    shapes = [(0, 0), (0, 3), (7, 0), (13, 1), (0, 1)]
    case = build_case(
        shapes,
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=4,
        dtype=dtype,
        seed=5,
        extra_columns=2,
    )
    # The table rows of the sequences without keys are never read: pure garbage.
    case.block_table[0] = -7
    case.block_table[1] = 10**6
    out, lse = call_attention(impl, case)
    padding = [0, 1, 2, 4]
    assert bool((out[padding] == 0).all()), out[padding]
    assert lse is None or bool((lse[padding] == -math.inf).all()), lse[padding]
    ref_out, ref_lse = spec_attention(case)
    assert_rows_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.clause("ATTN-EMPTY-1", "ATTN-PACK-1")
def test_a_batch_without_rows(impl):
    case = build_case(
        [(0, 0), (5, 0)],
        num_kv_heads=1,
        group=1,
        head_dim=64,
        block_size=2,
        dtype=torch.float32,
        seed=0,
    )
    out, lse = call_attention(impl, case)
    assert out.shape == (0, 1, 64) and (lse is None or lse.shape == (0, 1))


@pytest.mark.clause("ATTN-BOUNDS-1", "ATTN-LAYOUT-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_nothing_past_a_sequence_is_read(impl, dtype, poison):
    """Lengths that end inside a block, NaN/inf everywhere else, garbage table tails."""
    require_dtype(impl, dtype)
    shapes = [(17, 1), (33, 5), (1, 1), (16, 16)]
    case = build_case(
        shapes,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=11,
        spare_blocks=3,
        extra_columns=2,
    )
    written = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    for b, (seq_len, _) in enumerate(shapes):
        position = torch.arange(seq_len, device=DEVICE)
        written[case.block_table[b].long()[position // 16], position % 16] = True
    case.k_cache[~written] = poison
    case.v_cache[~written] = poison
    # Table tails: -1, an id past the cache, and the id of a block full of poison.
    unused_block = int((~written).all(dim=1).nonzero()[0])
    case.block_table[0, 2:] = -1
    case.block_table[1, 3] = case.k_cache.shape[0] + 100
    case.block_table[2, 1:] = unused_block
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = dense_attention(case)
    assert_rows_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.clause("ATTN-LAYOUT-1")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_physical_layout_is_invisible(impl, block_size):
    """The same sequences in blocks of any size, in any order, give the same output."""
    shapes = [(29, 4), (10, 1), (3, 3)]
    reference = build_case(
        shapes,
        num_kv_heads=2,
        group=2,
        head_dim=96,
        block_size=1,
        dtype=torch.float32,
        seed=21,
    )
    case = build_case(
        shapes,
        num_kv_heads=2,
        group=2,
        head_dim=96,
        block_size=block_size,
        dtype=torch.float32,
        seed=21,
        spare_blocks=4,
        layout_seed=block_size,
    )
    assert all(torch.equal(a, b) for a, b in zip(case.keys, reference.keys, strict=True))
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = dense_attention(reference)
    assert_rows_close(out, ref_out, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.clause("ATTN-LAYOUT-1")
def test_sequences_may_share_blocks(impl):
    """A common prefix stored once: two table rows point at the same blocks."""
    case = build_case(
        [(20, 1), (13, 2)],
        num_kv_heads=1,
        group=4,
        head_dim=64,
        block_size=4,
        dtype=torch.float32,
        seed=8,
    )
    # Sequence 1 becomes the first 13 positions of sequence 0, read from its blocks.
    case.block_table[1, :4] = case.block_table[0, :4]
    case.keys[1] = case.keys[0][:13]
    case.values[1] = case.values[0][:13]
    out, lse = call_attention(impl, case)
    ref_out, ref_lse = dense_attention(case)
    assert_rows_close(out, ref_out, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.clause("ATTN-CAUSAL-1", "ATTN-PACK-1")
@pytest.mark.boundary("many-kv-tiles")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_long_sequences(impl, dtype):
    """Long enough for a kernel to split the keys (split-KV, several tiles per row)."""
    require_dtype(impl, dtype)
    n = LONG_SEQ_LEN
    shapes = [(n, 1), (n - 5, 16), (n // 2 + 3, 1)]
    case = build_case(
        shapes,
        num_kv_heads=1,
        group=8,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        seed=n,
        spread=2.0,
    )
    assert_matches_spec(impl, case, dtype)


# Several KV tiles per row: a kernel's online softmax rescales its running output
# whenever a later tile raises the maximum. Ours also splits the keys of a sequence
# whose capacity holds two or more splits of 512 positions and merges the parts: on a
# GPU (LONG_SEQ_LEN 4100) in every run, in the interpreter under the thorough profile.
MANY_TILES_MIN_LEN = 2 * 64 + 1
MANY_TILES_MAX_LEN = max(LONG_SEQ_LEN, 1100 if THOROUGH else 0)


@pytest.mark.clause("ATTN-SCALE-1", "ATTN-CAUSAL-1", "ATTN-DTYPE-1", "ATTN-LSE-1")
@pytest.mark.boundary("many-kv-tiles")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@given(data=st.data())
def test_rows_over_many_kv_tiles_match_spec(impl, dtype, data):
    """One or two sequences of MANY_TILES_MIN_LEN to MANY_TILES_MAX_LEN positions, a
    few query rows each, in every dtype: the spec's output and log-sum-exp."""
    require_dtype(impl, dtype)
    lengths = st.integers(MANY_TILES_MIN_LEN, MANY_TILES_MAX_LEN)
    shapes = [
        (n, data.draw(st.integers(1, 4)))
        for n in data.draw(st.lists(lengths, min_size=1, max_size=2))
    ]
    case = build_case(
        shapes,
        num_kv_heads=data.draw(st.integers(1, 2)),
        group=data.draw(st.sampled_from((1, 3, 8))),
        head_dim=data.draw(st.sampled_from((64, 128))),
        block_size=data.draw(st.sampled_from(BLOCK_SIZES)),
        dtype=dtype,
        seed=data.draw(st.integers(0, 2**32 - 1)),
        spread=data.draw(st.sampled_from((1.0, 3.0))),
    )
    note(f"shapes={shapes}")
    assert_matches_spec(impl, case, dtype)


# Long enough for two splits of 512 positions even in the interpreter, where our
# kernel splits a lone decode row once its sequence's capacity holds two.
SPLIT_SEQ_LEN = 2 * 512 + 100


@pytest.mark.clause("ATTN-SCALE-1", "ATTN-LSE-1")
@pytest.mark.boundary("many-kv-tiles")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_rows_over_split_keys_match_spec(impl, dtype):
    """A decode row over SPLIT_SEQ_LEN positions: a kernel that
    cuts the keys into parts and merges them by log-sum-exp must merge exactly."""
    require_dtype(impl, dtype)
    case = build_case(
        [(SPLIT_SEQ_LEN, 1)],
        num_kv_heads=1,
        group=2,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=SPLIT_SEQ_LEN,
        spread=2.0,
    )
    assert_matches_spec(impl, case, dtype)


@pytest.mark.clause("ATTN-CAUSAL-1", "APPEND-SLOT-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_loop_appends_then_attends(impl, dtype):
    """Chunked prefill, decode steps and a request joining mid-way, through both operations.

    Each step appends the new tokens' keys and values at the slots of their
    positions, then attends; every output row must equal dense attention over
    the sequence so far.
    """
    require_dtype(impl, dtype)
    num_kv_heads, group, head_dim, block_size = 2, 3, 64, 4
    g = torch.Generator().manual_seed(99)
    total = {"a": 24, "b": 9, "c": 14}
    full = {
        name: [
            torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
            for _ in range(2)
        ]
        for name, n in total.items()
    }
    num_blocks = 16
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = with_guard_blocks(torch.full(cache_shape, math.nan, dtype=dtype, device=DEVICE), 1)
    v_cache = with_guard_blocks(torch.full(cache_shape, math.nan, dtype=dtype, device=DEVICE), 2)
    caches = {"k_cache": k_cache, "v_cache": v_cache}
    guards = guard_bits(caches)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = {name: [free.pop() for _ in range(-(-n // block_size))] for name, n in total.items()}
    length = dict.fromkeys(total, 0)
    # step -> new tokens per request (chunked prefill of a, b joins, c joins late, decodes)
    steps = [{"a": 8}, {"a": 8, "b": 5}, {"a": 7, "b": 1}, {"a": 1, "b": 3, "c": 14}, {"c": 0}]
    for step in steps:
        names = list(step)
        new_k, new_v, slots, starts = [], [], [], [0]
        for name in names:
            first, count = length[name], step[name]
            positions = range(first, first + count)
            slots += [
                tables[name][j // block_size] * block_size + j % block_size for j in positions
            ]
            new_k.append(full[name][0][first : first + count])
            new_v.append(full[name][1][first : first + count])
            length[name] += count
            starts.append(starts[-1] + count)
        key, value = torch.cat(new_k), torch.cat(new_v)
        slots += [-1, -1]  # padding rows with nothing to write
        padding = torch.randn(2, 2, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
        key, value = torch.cat([key, padding[0]]), torch.cat([value, padding[1]])
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        assert impl.op("append_kv")(key, value, k_cache, v_cache, slot_mapping) is None
        assert_guards_untouched(caches, guards)
        width = max(len(t) for t in tables.values())
        table = torch.tensor(
            [tables[name] + [-1] * (width - len(tables[name])) for name in names],
            dtype=torch.int32,
            device=DEVICE,
        )
        q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=g)
        case = Case(
            q=q.to(dtype).to(DEVICE),
            k_cache=k_cache,
            v_cache=v_cache,
            block_table=table,
            seq_lens=torch.tensor([length[n] for n in names], dtype=torch.int32, device=DEVICE),
            query_start=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            keys=[full[n][0][: length[n]] for n in names],
            values=[full[n][1][: length[n]] for n in names],
        )
        out, lse = call_attention(impl, case)
        ref_out, ref_lse = dense_attention(case)
        assert_rows_close(out, ref_out, dtype)
        assert_lse_close(lse, ref_lse, dtype)


# ---------------------------------------------------------------- validation


def valid_attention_args() -> dict:
    """Two sequences (5 and 3 positions, 2 and 1 new tokens), blocks of 2, GQA 4 over 2."""
    case = build_case(
        [(5, 2), (3, 1)],
        num_kv_heads=2,
        group=2,
        head_dim=16,
        block_size=2,
        dtype=torch.float32,
        seed=0,
        extra_columns=1,
    )
    names = ("q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start")
    return dict(zip(names, case.args, strict=True))


def _with(**changes):
    return lambda a: {**a, **{k: f(a) for k, f in changes.items()}}


def _set(name, index, value):
    def change(a):
        t = a[name].clone()
        t[index] = value
        return t

    return _with(**{name: change})


ATTENTION_ERRORS = {
    "q 2-D": (r"\bq\b", _with(q=lambda a: a["q"][:, 0])),
    "q integer": (r"\bq\b", _with(q=lambda a: a["q"].to(torch.int32))),
    "k_cache dtype": (r"\bk_cache\b", _with(k_cache=lambda a: a["k_cache"].double())),
    "k_cache 3-D": (r"\bk_cache\b", _with(k_cache=lambda a: a["k_cache"][0])),
    "v_cache shape": (r"\bv_cache\b", _with(v_cache=lambda a: a["v_cache"][:-1])),
    "v_cache dtype": (r"\bv_cache\b", _with(v_cache=lambda a: a["v_cache"].half())),
    "head_dim": (r"head_dim", _with(q=lambda a: a["q"][..., :-1])),
    "heads multiple": (r"num_kv_heads", _with(q=lambda a: a["q"][:, :3])),
    "block_table float": (
        r"\bblock_table\b",
        _with(block_table=lambda a: a["block_table"].float()),
    ),
    "block_table rows": (r"\bblock_table\b", _with(block_table=lambda a: a["block_table"][:1])),
    "block_table past end": (r"\bblock_table\b", _set("block_table", (0, 2), 10**4)),
    "block_table negative": (r"\bblock_table\b", _set("block_table", (1, 1), -1)),
    "seq_lens negative": (r"\bseq_lens\b", _set("seq_lens", 1, -1)),
    "seq_lens capacity": (r"\bseq_lens\b", _set("seq_lens", 0, 9)),
    "seq_lens float": (r"\bseq_lens\b", _with(seq_lens=lambda a: a["seq_lens"].float())),
    "seq_lens 2-D": (r"\bseq_lens\b", _with(seq_lens=lambda a: a["seq_lens"][None])),
    "query_start length": (
        r"\bquery_start\b",
        _with(query_start=lambda a: a["query_start"][:2]),
    ),
    "query_start first": (r"\bquery_start\b", _set("query_start", 0, 1)),
    "query_start last": (r"\bquery_start\b", _set("query_start", 2, 2)),
    "query_start decreasing": (r"\bquery_start\b", _set("query_start", 1, 4)),
    "more rows than positions": (r"\bquery_start\b", _set("seq_lens", 0, 1)),
}


@pytest.mark.clause("ATTN-VALID-1")
@pytest.mark.parametrize("mistake", sorted(ATTENTION_ERRORS))
def test_attention_rejects_invalid_arguments(impl, mistake):
    pattern, change = ATTENTION_ERRORS[mistake]
    args = change(valid_attention_args())
    with pytest.raises(ValueError, match=pattern):
        impl.op("paged_attention")(**args)


@pytest.mark.clause("ATTN-VALID-1")
@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_attention_rejects_non_finite_scale(impl, scale):
    with pytest.raises(ValueError, match=r"\bscale\b"):
        impl.op("paged_attention")(**valid_attention_args(), scale=scale)


# A tensor on another device than the queries: the CPU on a GPU box, and the
# "meta" device (shapes without data) elsewhere, so the check runs everywhere.
OTHER_DEVICE = "meta" if DEVICE.type == "cpu" else "cpu"


@pytest.mark.clause("ATTN-VALID-1")
@pytest.mark.parametrize("name", ["k_cache", "block_table", "seq_lens", "query_start"])
def test_attention_rejects_tensors_on_another_device(impl, name):
    args = valid_attention_args()
    args[name] = args[name].to(OTHER_DEVICE)
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        impl.op("paged_attention")(**args)


@pytest.mark.clause("ATTN-VALID-1")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize(
    "name", ["q", "k_cache", "v_cache", "block_table", "seq_lens", "query_start"]
)
def test_attention_names_an_argument_that_is_not_a_tensor(impl, name, kind):
    args = valid_attention_args()
    args[name] = 1.5 if kind == "float" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op("paged_attention")(**args)


@pytest.mark.clause("ATTN-VALID-1", "ATTN-BOUNDS-1")
def test_attention_accepts_garbage_in_unread_table_entries(impl):
    args = valid_attention_args()
    args["block_table"][0, 3] = -1  # sequence 0 uses 3 blocks of 2; column 3 is unread
    args["block_table"][1, 2:] = 10**6  # sequence 1 uses 2 blocks
    impl.op("paged_attention")(**args)


# ---------------------------------------------------------------- guard blocks
# (also used by the append tests, tests/conformance/test_append_kv.py)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a floating tensor, so NaN payloads compare too."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poison(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with NaN and ±inf sprinkled in: what earlier steps left behind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    which = torch.randint(0, 6, shape, generator=g)
    x[which == 0] = math.nan
    x[which == 1] = math.inf
    x[which == 2] = -math.inf
    return x.to(dtype).to(DEVICE)


def with_guard_blocks(cache: torch.Tensor, seed: int) -> torch.Tensor:
    """`cache`'s contents in the middle of a larger buffer, a block of poison before and after.

    The result is a contiguous slice of the buffer, as a cache must be. A write
    outside the cache (slot −1 taken as the row just before it, a slot past its
    end) then lands in a guard block, memory the test owns, where
    `assert_guards_untouched` reports it as a failed assertion, instead of in
    memory nobody owns, where it corrupts the Triton interpreter's heap.
    """
    guards = poison((2, *cache.shape[1:]), cache.dtype, seed)
    return torch.cat([guards[:1], cache, guards[1:]])[1:-1]


def guard_blocks(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks just before and just after a cache from `with_guard_blocks`, in its buffer."""
    block, shape, strides = cache.stride(0), cache.shape[1:], cache.stride()[1:]
    start = cache.storage_offset()
    return (
        cache.as_strided(shape, strides, start - block),
        cache.as_strided(shape, strides, start + cache.shape[0] * block),
    )


CACHES = ("k_cache", "v_cache")


def guard_bits(args: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The bits of the guard blocks of the caches in `args`, before a call."""
    return {name: tuple(bits(b).clone() for b in guard_blocks(args[name])) for name in CACHES}


def assert_guards_untouched(args: dict, before: dict) -> None:
    """Nothing was written just outside either cache (the guard blocks kept their bits)."""
    for name in CACHES:
        now = [bits(b) for b in guard_blocks(args[name])]
        changed = [
            where
            for where, old, new in zip(("before", "after"), before[name], now, strict=True)
            if not torch.equal(old, new)
        ]
        assert not changed, (
            f"append_kv wrote outside the cache: the guard rows {' and '.join(changed)} "
            f"{name} changed"
        )
