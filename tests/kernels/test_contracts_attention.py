"""What `paged_attention` and `append_kv` cost the host (issue 59), and their error words.

With `errors=` and the engine's host metadata (`max_query_len`, `max_seq_len`) given,
a call reads nothing from the device (no sync: CUDA-graph capture and an unstalled
launch queue), makes the launches its docstring budgets and no more (no empty one),
issues at most the small torch ops it budgets, and compiles one variant for a
steady-state decode whatever the batch size and the block table's width. Counted
by tests/kernels/contracts.py, with launches stubbed out, on `meta` tensors (a sync
there cannot even produce a value). The error words themselves are checked by
running the kernels (the interpreter): each bad value sets its bit, and is masked.
"""

from __future__ import annotations

import pytest
import torch

from decodespec import kernels
from decodespec.kernels import append, attention
from tests.kernels.contracts import record

ATTENTION = "_paged_attention_kernel"


def attention_args(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    width: int = 5,
    dtype: torch.dtype = torch.float32,
    device: str = "meta",
    num_blocks: int = 64,
) -> dict:
    """A call's tensors: 8 query heads over 2 KV heads, head_dim 64, blocks of 16."""
    block_size, num_kv_heads, head_dim = 16, 2, 64
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    table = torch.arange(len(q_lens) * width).reshape(len(q_lens), width) % num_blocks
    cache = (num_blocks, block_size, num_kv_heads, head_dim)
    return {
        "q": torch.zeros(int(starts[-1]), 8, head_dim, dtype=dtype, device=device),
        "k_cache": torch.zeros(cache, dtype=dtype, device=device),
        "v_cache": torch.zeros(cache, dtype=dtype, device=device),
        "block_table": table.to(torch.int32).to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start": starts.to(torch.int32).to(device),
        "errors": torch.empty(len(q_lens), dtype=torch.int32, device=device),
    }


def append_args(num_tokens: int, *, dtype: torch.dtype = torch.bfloat16, device="meta") -> dict:
    cache = (64, 16, 2, 64)
    return {
        "key": torch.zeros(num_tokens, 2, 64, dtype=dtype, device=device),
        "value": torch.zeros(num_tokens, 2, 64, dtype=dtype, device=device),
        "k_cache": torch.zeros(cache, dtype=torch.bfloat16, device=device),
        "v_cache": torch.zeros(cache, dtype=torch.bfloat16, device=device),
        "slot_mapping": torch.arange(num_tokens, device=device),
        "errors": torch.empty(num_tokens, dtype=torch.int32, device=device),
    }


DECODE = ([1] * 8, [70] * 8)
PREFILL_MIX = ([1, 30, 1, 9], [70, 30, 5, 60])

# (q_lens and seq_lens, keywords, launches, small ops): the docstring's budget.
ATTENTION_BUDGETS = {
    "decode": (DECODE, {"max_query_len": 1}, [ATTENTION], 0),
    "decode split": (DECODE, {"max_query_len": 1, "num_splits": 4}, [ATTENTION], 0),
    "prefill mix": (PREFILL_MIX, {"max_query_len": 30}, [ATTENTION, ATTENTION], 0),
    "prefill mix split": (
        PREFILL_MIX,
        {"max_query_len": 30, "num_splits": 3},
        [ATTENTION, ATTENTION],
        0,
    ),
    "float64": (DECODE, {"max_query_len": 1, "dtype": torch.float64}, [ATTENTION], 1),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_BUDGETS))
def test_attention_with_errors_and_metadata_never_syncs(case):
    (q_lens, seq_lens), keywords, launches, small_ops = ATTENTION_BUDGETS[case]
    keywords = dict(keywords)
    args = attention_args(q_lens, seq_lens, dtype=keywords.pop("dtype", torch.float32))
    call = lambda: kernels.paged_attention(**args, max_seq_len=80, **keywords)  # noqa: E731
    record(call)  # a split's first call on a device allocates the arrival counters
    rec = record(call)
    assert rec.syncs == []
    assert rec.kernels() == launches  # no empty launch: decode gets no long-tile launch
    assert len(rec.small_ops) <= small_ops, rec.small_ops


def test_attention_without_metadata_still_never_syncs():
    """Without max_query_len the long-tile launch is planned from the shapes (it may
    find no work): a surplus launch, never a device read."""
    args = attention_args(*DECODE)
    rec = record(lambda: kernels.paged_attention(**args))
    assert rec.syncs == [] and rec.kernels() == [ATTENTION, ATTENTION]


def test_attention_without_errors_syncs_once():
    args = attention_args(*PREFILL_MIX, device="cpu")
    del args["errors"]
    rec = record(lambda: kernels.paged_attention(**args, max_query_len=30))
    assert len(rec.syncs) == 1, rec.syncs


@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_compiles_once_for_every_decode_batch_and_table_width(num_splits):
    keys = {}
    for batch in (1, 3, 8, 16, 33):
        for width in (3, 5, 16, 17):
            args = attention_args([1] * batch, [40] * batch, width=width)
            rec = record(
                lambda args=args: kernels.paged_attention(
                    **args, max_query_len=1, num_splits=num_splits, return_lse=True
                )
            )
            for launch in rec.launches:
                keys.setdefault(launch.kernel, set()).add(launch.compile_key)
    assert {kernel: len(variants) for kernel, variants in keys.items()} == {ATTENTION: 1}


def test_append_with_errors_never_syncs():
    args, cast_args, empty = append_args(17), append_args(17, dtype=torch.float32), append_args(0)
    rec = record(lambda: kernels.append_kv(**args))
    assert rec.syncs == [] and rec.kernels() == ["_append_kv_kernel"] and rec.small_ops == []
    cast = record(lambda: kernels.append_kv(**cast_args))  # float32 into a bfloat16 cache
    assert cast.syncs == [] and len(cast.small_ops) <= 2, cast.small_ops
    assert record(lambda: kernels.append_kv(**empty)).launches == []


def test_append_without_errors_syncs_once_before_writing():
    args = append_args(5, device="cpu")
    del args["errors"]
    rec = record(lambda: kernels.append_kv(**args))
    assert len(rec.syncs) == 1, rec.syncs
    assert rec.kernels() == ["_append_kv_kernel"]


def test_append_compiles_once_for_every_batch():
    keys = set()
    for num_tokens in (1, 3, 16, 17, 64):
        args = append_args(num_tokens)
        (launch,) = record(lambda args=args: kernels.append_kv(**args)).launches
        keys.add(launch.compile_key)
    assert len(keys) == 1


# ---------------------------------------------------------------- the counter catches a sync


def _syncing(module, monkeypatch) -> None:
    """Make `module`'s wrapper read its error words on the host, as a careless edit could."""
    real = module.error_words

    def error_words(errors, rows, device):
        bool(errors.any())
        return real(errors, rows, device)

    monkeypatch.setattr(module, "error_words", error_words)


def test_a_sync_added_to_attention_is_counted(monkeypatch):
    _syncing(attention, monkeypatch)
    args = attention_args(*DECODE, device="cpu")
    assert record(lambda: kernels.paged_attention(**args, max_query_len=1)).syncs != []


def test_a_sync_added_to_append_is_counted(monkeypatch):
    _syncing(append, monkeypatch)
    args = append_args(3, device="cpu")
    assert record(lambda: kernels.append_kv(**args)).syncs != []


# ---------------------------------------------------------------- the words (interpreter)


def run_attention(args: dict, **keywords) -> list[int]:
    kernels.paged_attention(**args, **keywords)
    return args["errors"].tolist()


def test_each_bad_attention_value_sets_its_bit_and_nothing_raises():
    args = attention_args([1, 2, 1], [20, 40, 10], device="cpu", num_blocks=8)
    assert run_attention(args) == [0, 0, 0]
    args["block_table"][1, 2] = 10**6  # read: position 32 of 40
    args["block_table"][2, 4] = -1  # not read: sequence 2 has one block
    assert run_attention(args) == [0, attention.ERROR_BLOCK_ID_OUT_OF_RANGE, 0]
    args = attention_args([1, 2, 1], [20, 10**6, -3], device="cpu")
    bad_len = attention.ERROR_SEQ_LEN_OUT_OF_RANGE
    assert run_attention(args) == [0, bad_len, bad_len]
    args = attention_args([1, 2, 1], [20, 40, 10], device="cpu")
    assert run_attention(args, max_seq_len=30) == [0, bad_len, 0]
    args["query_start"][2] = 0  # [0, 1, 0, 4]: sequence 1 ends before it starts
    assert run_attention(args) == [0, attention.ERROR_QUERY_START_INVALID, 0]
    args = attention_args([1, 2, 1], [20, 1, 10], device="cpu")  # 2 rows, 1 position
    assert run_attention(args) == [0, attention.ERROR_QUERY_LEN_TOO_LONG, 0]
    args = attention_args([1, 20, 1], [20, 40, 10], device="cpu")
    assert run_attention(args, max_query_len=1) == [0, attention.ERROR_QUERY_LEN_TOO_LONG, 0]


def test_a_bad_slot_sets_its_bit_and_writes_nothing_there():
    args = append_args(3, dtype=torch.float32, device="cpu")
    args["key"].fill_(1.0)
    args["slot_mapping"] = torch.tensor([5, 10**6, -2])
    kernels.append_kv(**args)
    bad = append.ERROR_SLOT_OUT_OF_RANGE
    assert args["errors"].tolist() == [0, bad, bad]
    written = args["k_cache"].flatten(0, 1).ne(0).any(-1).any(-1).nonzero().flatten()
    assert written.tolist() == [5]
