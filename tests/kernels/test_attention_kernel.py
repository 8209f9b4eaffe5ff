"""What the Triton attention kernel promises beyond the spec's signature.

The conformance suite (tests/conformance/test_attention.py) checks
`decodespec.kernels.paged_attention` against the spec through the operation's common
signature. This module covers the kernel's own keyword, `num_splits`
(split-KV): every split count agrees with the spec, results are bitwise
reproducible, and bitwise the same for every split count; batch invariance
(issue 40): a sequence's rows are bitwise the same alone and in any batch,
whatever the table width and the split plan; the heuristic's choices, and the
wrapper's refusals; and 64-bit addressing of caches past 2^31 elements.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from decodespec import kernels
from decodespec.spec import registry
from tests.conformance.test_attention import (
    assert_lse_close,
    assert_rows_close,
    attention_cases,
    build_case,
    spec_attention,
)
from tests.strategies import DEVICE, FLOAT_DTYPES

SPLIT_COUNTS = (1, 2, 3, 7, 64)  # 64 leaves most splits of a short sequence empty
KV_CHUNK = kernels.attention.KV_CHUNK


def attend(case, **kwargs):
    return kernels.paged_attention(*case.args, scale=case.scale, return_lse=True, **kwargs)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@given(data=st.data())
def test_every_split_count_matches_the_spec(dtype, data):
    case = data.draw(attention_cases(dtype))
    num_splits = data.draw(st.sampled_from(SPLIT_COUNTS))
    note(f"seq_lens={case.seq_lens.tolist()} query_start={case.query_start.tolist()}")
    out, lse = attend(case, num_splits=num_splits)
    ref_out, ref_lse = spec_attention(case)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_rows_close(out, ref_out, dtype)
    assert_lse_close(lse, ref_lse, dtype)


def long_case(dtype: torch.dtype, seed: int = 0):
    """Decode and a prefill chunk over a few hundred positions, blocks of 16."""
    return build_case(
        [(300, 1), (250, 9), (7, 1), (0, 2)],
        num_kv_heads=2,
        group=3,
        head_dim=64,
        block_size=16,
        dtype=dtype,
        seed=seed,
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_results_are_bitwise_reproducible(dtype, num_splits):
    case = long_case(dtype)
    first_out, first_lse = attend(case, num_splits=num_splits)
    for _ in range(2):
        out, lse = attend(case, num_splits=num_splits)
        assert torch.equal(out.view(torch.uint8), first_out.view(torch.uint8))
        assert torch.equal(lse, first_lse)


def assert_bitwise_equal(got: tuple, expected: tuple, what: str = "") -> None:
    """(out, lse) pairs equal bit for bit, row by row (torch.equal, which says which)."""
    for name, a, b in zip(("out", "lse"), got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        different = (a != b).flatten(1).any(1)
        rows = different.nonzero().flatten().tolist()
        assert torch.equal(a, b), f"{what}: {name} of rows {rows} differs"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_split_count_does_not_change_a_bit(dtype):
    """Chunks at fixed boundaries, folded in order whoever computed them (issue 40)."""
    # Three chunks (1,328 positions of capacity): 4 and 9 splits leave programs
    # without a chunk.
    case = build_case(
        [(1300, 1), (1100, 6), (600, 1), (7, 1), (0, 2)],
        num_kv_heads=2,
        group=2,
        head_dim=16,
        block_size=16,
        dtype=dtype,
        seed=1,
    )
    base = attend(case, num_splits=1)
    for num_splits in (2, 3, 4, 9):
        assert_bitwise_equal(attend(case, num_splits=num_splits), base)


# ---------------------------------------------------------------- batch invariance


def make_sequence(seq_len: int, q_len: int, dtype: torch.dtype, seed: int) -> tuple:
    """One sequence's (q, keys, values): 2 KV heads, group 2, head_dim 16."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(seq_len, 2, 16, generator=g).to(dtype)
    values = torch.randn(seq_len, 2, 16, generator=g).to(dtype)
    return torch.randn(q_len, 4, 16, generator=g).to(dtype), keys, values


def paged_call(sequences: list[tuple], block_size: int, extra_columns: int, seed: int) -> tuple:
    """paged_attention's arguments for `sequences`, packed in this order, in a shuffled
    NaN-filled cache whose table is `extra_columns` wider than the longest needs (with
    garbage past each sequence's blocks)."""
    layout = torch.Generator().manual_seed(seed)
    dtype = sequences[0][1].dtype
    used = [-(-len(keys) // block_size) for _, keys, _ in sequences]
    num_blocks = sum(used) + 1
    order = torch.randperm(num_blocks, generator=layout)
    k_cache = torch.full((num_blocks, block_size, 2, 16), math.nan, dtype=dtype)
    v_cache = torch.full_like(k_cache, math.nan)
    table = torch.randint(-1, num_blocks, (len(sequences), max(used) + extra_columns))
    taken = 0
    for b, (_, keys, values) in enumerate(sequences):
        blocks = order[taken : taken + used[b]]
        taken += used[b]
        table[b, : used[b]] = blocks
        position = torch.arange(len(keys))
        k_cache[blocks[position // block_size], position % block_size] = keys
        v_cache[blocks[position // block_size], position % block_size] = values
    q_lens = torch.tensor([len(q) for q, _, _ in sequences])
    args = (
        torch.cat([q for q, _, _ in sequences]),
        k_cache,
        v_cache,
        table.to(torch.int32),
        torch.tensor([len(keys) for _, keys, _ in sequences], dtype=torch.int32),
        torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32),
    )
    return tuple(t.to(DEVICE) for t in args)


# (seq_len, q_len): decode rows and prefill chunks over one to four chunks of keys, a
# short decode row, a prefill, and padding rows without keys.
BATCH = [(1300, 1), (1600, 9), (40, 1), (1100, 1), (0, 2), (700, 3), (20, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_sequence_gives_the_same_bits_alone_and_in_any_batch(dtype):
    """Issue 40: each sequence alone (its own table row, only as wide as it needs,
    blocks of 16) against the batch (wider table, blocks of 16, other layout), decode
    rows only and decode rows with prefill chunks, under every split plan."""
    sequences = [make_sequence(n, q_len, dtype, seed=b) for b, (n, q_len) in enumerate(BATCH)]
    alone = [
        kernels.paged_attention(*paged_call([s], 16, 0, seed=b), return_lse=True)
        for b, s in enumerate(sequences)
    ]
    decode = [b for b, (_, q_len) in enumerate(BATCH) if q_len == 1]
    for members, extra_columns in ((decode, 3), (list(range(len(BATCH))), 40)):
        args = paged_call([sequences[b] for b in members], 16, extra_columns, seed=99)
        rows = torch.tensor([0] + [BATCH[b][1] for b in members]).cumsum(0).tolist()
        for num_splits in (None, 1, 2, 3, 7):
            out, lse = kernels.paged_attention(*args, return_lse=True, num_splits=num_splits)
            for i, b in enumerate(members):
                part = (out[rows[i] : rows[i + 1]], lse[rows[i] : rows[i + 1]])
                assert_bitwise_equal(part, alone[b], f"sequence {b} in {members}, {num_splits=}")


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16, 32, 64, 96])
def test_a_sequence_s_tile_shape_does_not_depend_on_the_batch(group, fp64):
    """On a GPU the tile shape changes a row's last bits (an H200 showed it; the
    interpreter does not), so the launch that takes a sequence, and its block sizes,
    must follow from the sequence's own q_len: never from num_tokens or batch."""

    def tile_shape(q_len: int, num_tokens: int, batch: int) -> tuple:
        launches = kernels.attention._launches(num_tokens, batch, group, 128, fp64)
        taken = [
            tuple(sorted(tiles.items()))
            for tiles, _, one_tile, short_q_len in launches
            if (q_len <= tiles["BLOCK_Q"] if one_tile else q_len > short_q_len)
        ]
        assert len(taken) == 1, f"q_len {q_len} is taken by {len(taken)} launches"
        return taken[0]

    for q_len in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64, 100, 2048):
        batches = [(q_len, 1), (q_len + 1, 2), (q_len + 60, 3), (q_len + 5000, 300)]
        assert len({tile_shape(q_len, *batch) for batch in batches}) == 1


def test_the_heuristic_split_count_does_not_change_a_bit(h100_like):
    """A decode batch over long contexts is split on a GPU of 132 multiprocessors; the
    bits are those of one program per tile."""
    sequences = [make_sequence(n, 1, torch.float32, seed=n) for n in (1300, 1100, 600)]
    args = paged_call(sequences, 16, 100, seed=0)  # a table of 2,912 positions: 6 chunks
    assert kernels.attention.default_num_splits(args[0], args[1], args[3], args[4]) > 1
    assert_bitwise_equal(
        kernels.paged_attention(*args, return_lse=True),
        kernels.paged_attention(*args, return_lse=True, num_splits=1),
    )


def test_rows_without_keys_merge_to_zeros_and_minus_inf():
    """Every split of a padding row is empty: the merge must not divide 0 by 0."""
    case = long_case(torch.float32)
    out, lse = attend(case, num_splits=4)
    assert bool((out[-2:] == 0).all()) and bool((lse[-2:] == -math.inf).all())


@pytest.mark.parametrize("num_splits", [0, -1, 1.5, True, "2", 257])
def test_bad_split_counts_are_refused(num_splits):
    case = long_case(torch.float32)
    with pytest.raises(ValueError, match=r"\bnum_splits\b"):
        kernels.paged_attention(*case.args, num_splits=num_splits)


# ---------------------------------------------------------------- the heuristic


@pytest.fixture
def h100_like(monkeypatch):
    """choose_num_splits as on a GPU with 132 multiprocessors."""
    monkeypatch.setattr(kernels.attention, "_multiprocessor_count", lambda device: 132)


def test_a_small_batch_over_a_long_context_is_split(h100_like):
    # batch 1 decode, 8 KV heads, 64k positions: 2 tiles x 8 heads = 16 programs
    num_splits = kernels.attention.choose_num_splits(2, 8, 65_536, DEVICE)
    assert 1 < num_splits <= kernels.attention.MAX_SPLITS
    assert 2 * 8 * num_splits >= 4 * 132 or num_splits == kernels.attention.MAX_SPLITS


def test_a_batch_that_fills_the_gpu_is_not_split(h100_like):
    assert kernels.attention.choose_num_splits(80, 8, 8192, DEVICE) == 1


def test_there_are_never_more_splits_than_chunks(h100_like):
    for capacity in (100, 511, 512, 513, 1500, 4096):
        num_splits = kernels.attention.choose_num_splits(1, 1, capacity, DEVICE)
        assert num_splits == -(-capacity // KV_CHUNK)


def test_the_default_split_count_comes_from_the_heuristic(monkeypatch):
    case = long_case(torch.float32)
    chosen = []

    def choose(*args):
        chosen.append(args)
        return 3

    monkeypatch.setattr(kernels.attention, "choose_num_splits", choose)
    out, _ = attend(case)
    assert len(chosen) == 1
    num_tiles, num_kv_heads, capacity, device = chosen[0]
    assert num_kv_heads == 2 and capacity == case.block_table.shape[1] * 16
    assert device == case.q.device and num_tiles >= len(case.seq_lens)
    forced_out, _ = attend(case, num_splits=3)
    assert torch.equal(out, forced_out)


# ---------------------------------------------------------------- devices and addressing


def test_cpu_tensors_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels.checks, "INTERPRET", False)
    case = long_case(torch.float32)
    args = [t.cpu() for t in case.args]
    with pytest.raises(ValueError, match=r"\bq\b.*TRITON_INTERPRET"):
        kernels.paged_attention(*args)


def test_caches_larger_than_2_31_elements_are_addressed_in_64_bits():
    """The sequence lives in the last blocks of caches of 2^31 + elements each.

    `torch.empty` only reserves address space: the pages the test never
    writes are never touched, so this costs little memory even on a laptop.
    A 32-bit slot offset would wrap and read (or fault on) the wrong address.
    """
    block_size, num_kv_heads, head_dim = 16, 1, 64
    num_blocks = 2**31 // (block_size * num_kv_heads * head_dim) + 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    v_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(20, num_kv_heads, head_dim, generator=g).half().to(DEVICE)
    values = torch.randn(20, num_kv_heads, head_dim, generator=g).half().to(DEVICE)
    table = torch.tensor([[num_blocks - 1, num_blocks - 3]], device=DEVICE)
    position = torch.arange(20, device=DEVICE)
    k_cache[table[0, position // block_size], position % block_size] = keys
    v_cache[table[0, position // block_size], position % block_size] = values
    q = torch.randn(3, 2, head_dim, generator=g).half().to(DEVICE)
    seq_lens = torch.tensor([20], device=DEVICE)
    query_start = torch.tensor([0, 3], device=DEVICE)
    out, lse = kernels.paged_attention(
        q, k_cache, v_cache, table, seq_lens, query_start, return_lse=True
    )

    # The same sequence in a small cache, through the spec.
    small_k = torch.zeros(2, block_size, num_kv_heads, head_dim, dtype=torch.float64)
    small_v = torch.zeros_like(small_k)
    small_k[position.cpu() // block_size, position.cpu() % block_size] = keys.double().cpu()
    small_v[position.cpu() // block_size, position.cpu() % block_size] = values.double().cpu()
    ref_out, ref_lse = registry.OPERATIONS["paged_attention"].reference(
        q.double().cpu(),
        small_k,
        small_v,
        torch.tensor([[0, 1]]),
        seq_lens.cpu(),
        query_start.cpu(),
        return_lse=True,
    )
    assert_rows_close(out, ref_out, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)
