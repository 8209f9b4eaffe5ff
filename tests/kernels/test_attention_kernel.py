"""What the Triton attention kernel promises beyond the spec's signature.

The conformance suite (tests/conformance/test_attention.py) checks
`decodespec.kernels.paged_attention` against the spec through the operation's common
signature. This module covers the kernel's own keyword, `num_splits`
(split-KV): every split count agrees with the spec, results are bitwise
reproducible, a different split count moves results only within rounding, the
heuristic's choices, and the wrapper's refusals; and 64-bit addressing of
caches past 2^31 elements.
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

RTOL = registry.OPERATIONS["paged_attention"].tolerance.rtol
SPLIT_COUNTS = (1, 2, 3, 7, 64)  # 64 leaves most splits of a short sequence empty


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


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_split_count_changes_results_only_within_rounding(dtype):
    case = long_case(dtype, seed=1)
    base_out, base_lse = attend(case, num_splits=1)
    for num_splits in (2, 4, 19):
        out, lse = attend(case, num_splits=num_splits)
        assert_rows_close(out, base_out.double(), dtype, rtol=2 * RTOL[dtype])
        assert_lse_close(lse, base_lse.double(), dtype)


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


def test_splits_are_never_shorter_than_the_minimum(h100_like):
    for capacity in (100, 511, 512, 1500, 4096):
        num_splits = kernels.attention.choose_num_splits(1, 1, capacity, DEVICE)
        assert num_splits == max(1, capacity // kernels.attention.MIN_SPLIT_LEN)


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
