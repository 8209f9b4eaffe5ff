"""Conformance: batch invariance — a row computed alone has the bits it has in any batch.

The invariance checker of issue 40, one test per operation family: each row
(a sequence, for attention) is computed alone, and inside batches of other
sizes and contents drawn by hypothesis, and the two must be equal bit for
bit (`torch.equal`: −0 and +0 count as equal, as the clauses say). Unlike the
other conformance tests, nothing is compared with the spec here: the
property is about the implementation alone, and a failure names the row
and the batch it was computed in.

- ATTN-INVARIANT-1: a sequence alone (its own block-table row, a table only
  as wide as it needs) against the same sequence in a batch of decode rows,
  prefill chunks and idle sequences with a wider table.
- SAMPLE-INVARIANT-1: `process_logits`, `sample` and `compute_logprobs`
  of a row alone (without the processor tensors it does not need) against
  the row in a batch whose other rows use logit bias, min_tokens and
  penalties, greedy and sampled rows mixed.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from tests.conformance.test_attention import (
    BLOCK_SIZES,
    GROUPS,
    HEAD_DIMS,
    INDEX_DTYPES,
    KEYLESS,
    MAX_KV_HEADS,
    MAX_SEQS,
    SEQUENCE_KINDS,
    build_case,
    call_attention,
    require_dtype,
    sequence_shapes,
)
from tests.strategies import DEVICE, FLOAT_DTYPES, logits, per_row, sampling_args

# ---------------------------------------------------------------- attention


def sequence_alone(case, b: int) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """Sequence b's call by itself: (args, first row, end row) of its rows in the batch."""
    q, k_cache, v_cache, block_table, seq_lens, query_start = case.args
    start, end = int(query_start[b]), int(query_start[b + 1])
    seq_len = int(seq_lens[b])
    block_size = k_cache.shape[1]
    width = max(1, -(-seq_len // block_size))  # only the blocks it uses
    args = (
        q[start:end],
        k_cache,
        v_cache,
        block_table[b : b + 1, :width].clone(),
        seq_lens[b : b + 1].clone(),
        torch.tensor([0, end - start], dtype=query_start.dtype, device=DEVICE),
    )
    return args, start, end


@pytest.mark.clause("ATTN-INVARIANT-1")
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(data=st.data())
def test_a_sequence_has_the_same_bits_alone_and_in_any_batch(impl, dtype, data):
    require_dtype(impl, dtype)
    # Sequences with keys: one without is ATTN-EMPTY-1's case, alone or not.
    kinds = tuple(kind for kind in SEQUENCE_KINDS if kind not in KEYLESS)
    shapes = data.draw(st.lists(sequence_shapes(kinds), min_size=2, max_size=MAX_SEQS + 2))
    case = build_case(
        shapes,
        num_kv_heads=data.draw(st.integers(1, MAX_KV_HEADS)),
        group=data.draw(st.sampled_from(GROUPS)),
        head_dim=data.draw(st.sampled_from(HEAD_DIMS)),
        block_size=data.draw(st.sampled_from(BLOCK_SIZES)),
        dtype=dtype,
        seed=data.draw(st.integers(0, 2**32 - 1)),
        extra_columns=data.draw(st.integers(0, 4)),  # a table wider than any sequence needs
        index_dtype=data.draw(st.sampled_from(INDEX_DTYPES)),
    )
    note(f"(seq_len, q_len) per sequence: {shapes}; block table {tuple(case.block_table.shape)}")
    whole, whole_lse = call_attention(impl, case)
    attention = impl.op("paged_attention")
    lse_supported = impl.supports("lse")
    for b in range(len(shapes)):
        args, start, end = sequence_alone(case, b)
        if end == start:
            continue
        if lse_supported:
            out, lse = attention(*args, return_lse=True)
        else:
            out, lse = attention(*args), None
        assert torch.equal(out, whole[start:end]), (
            f"sequence {b} {shapes[b]}: its rows alone differ from its rows in the batch "
            f"(largest difference {(out.double() - whole[start:end].double()).abs().max():.3g})"
        )
        if lse is not None:
            assert torch.equal(lse, whole_lse[start:end]), f"sequence {b}: its lse differs"


# ---------------------------------------------------------------- sampling stages


def processor_rows(impl, data, args: dict, batch: int, vocab: int) -> list[set[str]]:
    """Draw into `args` each processor group the implementation supports, on for some
    rows and neutral (bias 0, min_tokens 0, penalties 1 / 0 / 0) for the others; for
    each row, the tensors it can be called without alone."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
    droppable: list[set[str]] = [set() for _ in range(batch)]

    def neutral_rows(names: tuple[str, ...]) -> torch.Tensor:
        rows = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
        for row in rows.nonzero().flatten().tolist():
            droppable[row].update(names)
        return rows.to(DEVICE)

    if impl.supports("logit_bias") and data.draw(st.booleans()):
        bias = (torch.rand(batch, vocab, generator=g) * 20 - 10).to(DEVICE)
        args["logit_bias"] = bias * ~neutral_rows(("logit_bias",))[:, None]
    if impl.supports("min_tokens") and data.draw(st.booleans()):
        args["stop_token_mask"] = (torch.rand(batch, vocab, generator=g) < 0.1).to(DEVICE)
        min_tokens = per_row(data.draw, batch, st.integers(1, 3), torch.int64)
        args["min_tokens"] = min_tokens * ~neutral_rows(("stop_token_mask", "min_tokens"))
        args["step"] = per_row(data.draw, batch, st.integers(0, 4), torch.int64)
    if impl.supports("penalties") and data.draw(st.booleans()):
        penalties = ("repetition_penalty", "frequency_penalty", "presence_penalty")
        args["prompt_mask"] = (torch.rand(batch, vocab, generator=g) < 0.3).to(DEVICE)
        args["output_counts"] = torch.randint(0, 3, (batch, vocab), generator=g).to(DEVICE)
        args["output_counts"] = args["output_counts"].to(torch.int32)
        neutral = neutral_rows(("prompt_mask", "output_counts", *penalties))
        for name, values, identity in zip(
            penalties,
            (st.floats(0.5, 2.0), st.floats(-2, 2), st.floats(-2, 2)),
            (1.0, 0.0, 0.0),
            strict=True,
        ):
            drawn = per_row(data.draw, batch, values, torch.float32)
            args[name] = torch.where(neutral, identity, drawn)
    return droppable


def mixed_batch(impl, data, x: torch.Tensor) -> tuple[dict, list[set[str]]]:
    """Sampling arguments, greedy and sampled rows mixed, and processor rows."""
    batch, vocab = x.shape
    args = data.draw(sampling_args(batch, vocab))
    return args, processor_rows(impl, data, args, batch, vocab)


def row_alone(args: dict, row: int, drop: set[str]) -> dict:
    return {k: v[row : row + 1] for k, v in args.items() if k not in drop}


def call_or_reject(function, *args, **kwargs):
    """The call's result, or None when its rows are invalid (SAMPLE-VALID-1: they raise
    alone and in the batch alike, which other tests check) or the implementation has no
    such processor value (NotImplementedError: a peer's gap, which other tests record)."""
    try:
        return function(*args, **kwargs)
    except (ValueError, NotImplementedError):
        return None


@pytest.mark.clause("SAMPLE-INVARIANT-1")
@given(x=logits(), data=st.data())
def test_a_processed_row_has_the_same_bits_alone_and_in_any_batch(impl, x, data):
    args, droppable = mixed_batch(impl, data, x)
    args.pop("seed")
    process = impl.op("process_logits")
    whole = call_or_reject(process, x, **args)
    if whole is None:
        return
    for row in range(x.shape[0]):
        alone = process(x[row : row + 1], **row_alone(args, row, droppable[row]))
        assert torch.equal(alone[0], whole[row]), (
            f"row {row} processed alone (without {sorted(droppable[row])}) differs from "
            f"the same row in a batch of {x.shape[0]}"
        )


@pytest.mark.clause("SAMPLE-INVARIANT-1")
@given(x=logits(), data=st.data())
def test_a_sampled_row_has_the_same_token_alone_and_in_any_batch(impl, x, data):
    args, droppable = mixed_batch(impl, data, x)
    sample = impl.op("sample")
    whole = call_or_reject(sample, x, **args)
    if whole is None:
        return
    for row in range(x.shape[0]):
        alone = sample(x[row : row + 1], **row_alone(args, row, droppable[row]))
        assert alone.tolist() == whole[row : row + 1].tolist(), (
            f"row {row} sampled alone (without {sorted(droppable[row])}) gives token "
            f"{alone.tolist()}, in a batch of {x.shape[0]} {whole[row].item()}"
        )


@pytest.mark.clause("SAMPLE-INVARIANT-1")
@given(x=logits(dtypes=FLOAT_DTYPES), data=st.data())
def test_a_row_has_the_same_logprobs_alone_and_in_any_batch(impl, x, data):
    batch, vocab = x.shape
    token_ids = torch.tensor(
        data.draw(st.lists(st.integers(0, vocab - 1), min_size=batch, max_size=batch)),
        device=DEVICE,
    )
    # A finite chosen token: a masked one (−inf) has no rank to compare.
    token_ids = torch.where(torch.isfinite(x[torch.arange(batch), token_ids]), token_ids,
                            x.float().argmax(-1))  # fmt: skip
    num_top = data.draw(st.integers(0, min(20, vocab)))
    compute = impl.op("compute_logprobs")
    whole = compute(x, token_ids, num_top)
    for row in range(batch):
        alone = compute(x[row : row + 1], token_ids[row : row + 1], num_top)
        for name, got, batched in zip(whole._fields, alone, whole, strict=True):
            assert torch.equal(got[0], batched[row]), (
                f"row {row}: {name} alone {got[0].tolist()} differs from {batched[row].tolist()} "
                f"in a batch of {batch}"
            )
