"""Properties of the attention and append stages (spec/attention.py, spec/append.py).

The spec is cross-checked against `dense_attention`, an independent float64
reference written straight from SEMANTICS.md on contiguous copies of each
sequence (tests/conformance/test_attention.py), and against consequences of
its definition: batch invariance, chunked prefill equal to a one-shot
prefill, and log-sum-exp merging of split keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.append import append_kv
from decodespec.spec.attention import paged_attention
from tests.conformance.test_attention import attention_cases, dense_attention

DTYPES = (torch.float64, torch.float32, torch.bfloat16)


def assert_float64_close(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-12) -> None:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape
    same_inf = (out == ref) & torch.isinf(ref)
    finite = torch.isfinite(ref)
    assert bool((same_inf | finite).all())
    diff = (out - ref)[finite].abs()
    assert bool((diff <= rtol * ref[finite].abs().clamp(min=1)).all()), diff.max()


@pytest.mark.clause(
    "ATTN-LAYOUT-1",
    "ATTN-PACK-1",
    "ATTN-CAUSAL-1",
    "ATTN-SCALE-1",
    "ATTN-GQA-1",
    "ATTN-LSE-1",
    "ATTN-EMPTY-1",
    "ATTN-BOUNDS-1",
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_spec_equals_dense_attention_on_contiguous_keys(dtype, data):
    case = data.draw(attention_cases(dtype))
    out, lse = paged_attention(*case.float64_args(), scale=case.scale, return_lse=True)
    ref_out, ref_lse = dense_attention(case)
    assert_float64_close(out, ref_out)
    assert_float64_close(lse, ref_lse)


@pytest.mark.clause("ATTN-PACK-1")
@given(case=attention_cases(torch.float32))
def test_a_sequence_does_not_depend_on_its_batch(case):
    out = paged_attention(*case.args, scale=case.scale)
    starts = case.query_start.tolist()
    for b in range(len(case.keys)):
        rows = slice(starts[b], starts[b + 1])
        alone = paged_attention(
            case.q[rows],
            case.k_cache,
            case.v_cache,
            case.block_table[b : b + 1],
            case.seq_lens[b : b + 1],
            case.query_start.new_tensor([0, starts[b + 1] - starts[b]]),
            scale=case.scale,
        )
        assert torch.equal(alone, out[rows]), b


def empty_cache(num_blocks: int, block_size: int, heads: int, head_dim: int) -> torch.Tensor:
    return torch.full((num_blocks, block_size, heads, head_dim), math.nan, dtype=torch.float64)


@pytest.mark.clause("ATTN-CAUSAL-1", "APPEND-SLOT-1")
@given(
    prompt=st.integers(1, 40),
    chunks=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    decode_steps=st.integers(0, 4),
    block_size=st.sampled_from((1, 3, 16)),
    seed=st.integers(0, 2**32 - 1),
)
def test_chunked_prefill_and_decode_equal_one_shot_prefill(
    prompt, chunks, decode_steps, block_size, seed
):
    """Any split of a sequence into steps gives every position the same output row."""
    g = torch.Generator().manual_seed(seed)
    n = prompt + decode_steps
    heads, group, head_dim = 2, 2, 64
    q = torch.randn(n, heads * group, head_dim, generator=g, dtype=torch.float64)
    keys = torch.randn(n, heads, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(n, heads, head_dim, generator=g, dtype=torch.float64)
    num_blocks = -(-n // block_size) + 1
    table = torch.randperm(num_blocks, generator=g)[None, :]

    def slots(first: int, count: int) -> torch.Tensor:
        j = torch.arange(first, first + count)
        return table[0, j // block_size] * block_size + j % block_size

    def run(steps: list[int]) -> torch.Tensor:
        k_cache = empty_cache(num_blocks, block_size, heads, head_dim)
        v_cache = empty_cache(num_blocks, block_size, heads, head_dim)
        rows, done = [], 0
        for count in steps:
            new = slice(done, done + count)
            append_kv(keys[new], values[new], k_cache, v_cache, slots(done, count))
            done += count
            rows.append(
                paged_attention(
                    q[new], k_cache, v_cache, table, torch.tensor([done]), torch.tensor([0, count])
                )
            )
        return torch.cat(rows)

    steps, left = [], prompt
    for c in chunks:
        if left > 0:
            steps.append(min(c, left))
            left -= steps[-1]
    steps += [left] if left else []
    steps += [1] * decode_steps
    assert_float64_close(run(steps), run([n]))


@pytest.mark.clause("ATTN-LSE-1")
@given(n=st.integers(2, 60), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_log_sum_exp_merges_attention_over_split_keys(n, data, seed):
    """Attention over keys [0, m) and [m, n) separately, merged by lse, equals the whole."""
    m = data.draw(st.integers(1, n - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3, 64, generator=g, dtype=torch.float64)
    keys = torch.randn(n, 1, 64, generator=g, dtype=torch.float64)
    values = torch.randn(n, 1, 64, generator=g, dtype=torch.float64)

    def decode(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one sequence, blocks of one slot in order
        return paged_attention(
            q,
            k[:, None],
            v[:, None],
            torch.arange(k.shape[0])[None],
            torch.tensor([k.shape[0]]),
            torch.tensor([0, 1]),
            return_lse=True,
        )

    whole, whole_lse = decode(keys, values)
    first, first_lse = decode(keys[:m], values[:m])
    second, second_lse = decode(keys[m:], values[m:])
    lse = torch.logaddexp(first_lse, second_lse)
    merged = (first_lse - lse).exp()[..., None] * first + (second_lse - lse).exp()[
        ..., None
    ] * second
    assert_float64_close(lse, whole_lse)
    assert_float64_close(merged, whole)
