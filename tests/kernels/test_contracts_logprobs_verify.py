"""What `compute_logprobs`, `verify_drafts` and `apply_token_bitmask` cost the host.

Each wrapper's docstring states its contract (issue 59): with `errors=` given, no
host sync (a sync stalls the launch queue and breaks CUDA-graph capture), one
launch and no other device operation; one compiled kernel whatever the batch and
vocabulary. `tests/kernels/contracts.py` counts them with every launch stubbed out,
on `meta` tensors (a sync there cannot even produce a value), so no GPU is needed.
The last tests check that the counter does see a sync, a launch and an operation
added to a wrapper's path, so that a passing contract means something.
"""

from __future__ import annotations

import pytest
import torch

from decodespec import kernels
from decodespec.kernels import logprobs, quant_linear, speculative, token_mask, workspace
from decodespec.kernels.checks import INTERPRET
from tests.kernels.contracts import record

META = torch.device("meta")
VOCABS = [32000, 32001, 128256, 151936]
BATCHES = [1, 3, 64]


def words(rows: int, device: torch.device = META) -> torch.Tensor:
    return torch.empty(rows, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- the calls


def logprobs_call(batch: int, vocab: int, device: torch.device = META, **kw):
    logits = torch.empty(batch, vocab, dtype=torch.bfloat16, device=device)
    token_ids = torch.zeros(batch, dtype=torch.int64, device=device)
    return lambda: kernels.compute_logprobs(logits, token_ids, 5, **kw)


def verify_call(
    batch: int, vocab: int, device: torch.device = META, k: int = 4, seeded: bool = True, **kw
):
    args = {
        "draft_tokens": torch.zeros(batch, k, dtype=torch.int64, device=device),
        "draft_probs": torch.full((batch, k, vocab), 1 / vocab, device=device),
        "target_probs": torch.full((batch, k + 1, vocab), 1 / vocab, device=device),
        "num_draft": torch.full((batch,), k, dtype=torch.int64, device=device),
        "temperature": torch.ones(batch, device=device)
        if seeded
        else torch.zeros(batch, device=device),
    }
    if seeded:
        args["seed"] = torch.arange(batch, device=device)
        args["step"] = torch.zeros(batch, dtype=torch.int64, device=device)
    return lambda: kernels.verify_drafts(**args, **kw)


def mask_call(batch: int, vocab: int, device: torch.device = META, indexed: bool = True, **kw):
    logits = torch.empty(batch, vocab, dtype=torch.bfloat16, device=device)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    indices = torch.arange(0, batch, 2, device=device) if indexed else None
    return lambda: kernels.apply_token_bitmask(logits, bitmask, indices, **kw)


def mask_rows(batch: int, indexed: bool = True) -> int:
    return len(range(0, batch, 2)) if indexed else batch


# ---------------------------------------------------------------- with errors=


@pytest.mark.parametrize("batch", BATCHES)
def test_logprobs_with_errors_never_syncs(batch):
    rec = record(logprobs_call(batch, 32000, errors=words(batch)))
    assert rec.syncs == []
    assert rec.kernels() == ["_logprobs_kernel"]
    assert rec.launches[0].grid == (batch,)
    assert rec.small_ops == []


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("batch", BATCHES)
def test_verify_with_errors_never_syncs(batch, seeded):
    rec = record(verify_call(batch, 32000, seeded=seeded, errors=words(batch)))
    assert rec.syncs == []
    assert rec.kernels() == ["_verify_kernel"]
    assert rec.launches[0].grid == (batch,)
    # No zeros for an absent seed or step: HAS_SEED / HAS_STEP are constexprs.
    assert rec.small_ops == []
    assert rec.launches[0].constexprs["HAS_SEED"] is seeded
    assert rec.launches[0].constexprs["HAS_STEP"] is seeded


@pytest.mark.parametrize("indexed", [True, False])
@pytest.mark.parametrize("batch", BATCHES)
def test_token_mask_with_errors_never_syncs(batch, indexed):
    rec = record(mask_call(batch, 32000, indexed=indexed, errors=words(mask_rows(batch, indexed))))
    assert rec.syncs == []
    assert rec.kernels() == ["_apply_token_bitmask_kernel"]
    assert rec.small_ops == []  # no copy of the rows outside `indices` first


@pytest.mark.parametrize("batch", BATCHES)
def test_token_mask_without_indices_never_syncs(batch):
    """Without `indices` no value can be wrong: nothing to read back, even by default."""
    rec = record(mask_call(batch, 32000, indexed=False))
    assert rec.syncs == []
    assert rec.kernels() == ["_apply_token_bitmask_kernel"]
    assert rec.small_ops == []


# ---------------------------------------------------------------- without errors=


@pytest.mark.parametrize(
    "call",
    [
        lambda: logprobs_call(3, 100, torch.device("cpu")),
        lambda: verify_call(3, 100, torch.device("cpu")),
        lambda: mask_call(3, 100, torch.device("cpu")),
    ],
    ids=["logprobs", "verify", "token_mask"],
)
def test_without_errors_one_sync_after_the_launch(call):
    """The words are cleared (1 operation), the kernel launched, the words read once.
    (The stub writes nothing: the cleared words report no error.)"""
    rec = record(call())
    assert len(rec.launches) == 1
    assert rec.syncs == ["aten._local_scalar_dense"]
    assert rec.small_ops == ["aten.zeros", "aten.any"]


# ---------------------------------------------------------------- one compiled kernel


@pytest.mark.parametrize(
    ("name", "call", "rows"),
    [
        ("logprobs", logprobs_call, lambda b: b),
        ("verify", verify_call, lambda b: b),
        ("token_mask", mask_call, mask_rows),
    ],
)
def test_one_compiled_kernel_for_every_batch_and_vocabulary(name, call, rows):
    keys = {
        (batch, vocab): record(call(batch, vocab, errors=words(rows(batch)))).launches[0]
        for batch in BATCHES
        for vocab in VOCABS
    }
    distinct = {launch.compile_key for launch in keys.values()}
    assert len(distinct) == 1, f"{name}: {len(distinct)} compile keys over {list(keys)}"


# ---------------------------------------------------------------- the counter counts


def _with(monkeypatch, module, extra):
    """Make `module.error_words` (on every wrapper's path) also run `extra(words)`."""
    original = module.error_words

    def error_words(errors, rows, device):
        out = original(errors, rows, device)
        extra(out)
        return out

    monkeypatch.setattr(module, "error_words", error_words)


CALLS = {
    "logprobs": (logprobs, lambda e: logprobs_call(3, 100, torch.device("cpu"), errors=e), 3),
    "verify": (speculative, lambda e: verify_call(3, 100, torch.device("cpu"), errors=e), 3),
    "token_mask": (token_mask, lambda e: mask_call(3, 100, torch.device("cpu"), errors=e), 2),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_added_sync_is_counted(monkeypatch, name):
    module, call, rows = CALLS[name]
    _with(monkeypatch, module, lambda t: bool(t.any()))
    rec = record(call(torch.zeros(rows, dtype=torch.int32)))
    assert "aten._local_scalar_dense" in rec.syncs


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_added_operation_is_counted(monkeypatch, name):
    module, call, rows = CALLS[name]
    _with(monkeypatch, module, lambda t: t.add_(0))
    rec = record(call(torch.zeros(rows, dtype=torch.int32)))
    assert rec.syncs == [] and "aten.add_" in rec.small_ops


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_added_launch_is_counted(monkeypatch, name):
    module, call, rows = CALLS[name]
    # Another wrapper's launch (not this module's: its error_words is patched).
    other = (mask_call if name == "logprobs" else logprobs_call)(
        1, 8, torch.device("cpu"), errors=torch.zeros(1, dtype=torch.int32)
    )
    _with(monkeypatch, module, lambda t: other())
    rec = record(call(torch.zeros(rows, dtype=torch.int32)))
    assert len(rec.launches) == 2


# ---------------------------------------------------------------- the words, run


def test_logprobs_words_flag_each_row_and_its_outputs():
    x = torch.randn(3, 50)
    x[1, 3] = float("nan")
    e = torch.full((3,), 7, dtype=torch.int32)
    out = kernels.compute_logprobs(x, torch.tensor([0, 1, 50]), 3, errors=e)
    assert e.tolist() == [0, logprobs.ERROR_INVALID_LOGITS, logprobs.ERROR_TOKEN_OUT_OF_RANGE]
    assert out.ranks[1:].tolist() == [0, 0] and out.top_token_ids[1:].eq(-1).all()
    assert torch.isnan(out.token_logprobs[1:]).all()
    with pytest.raises(ValueError, match="token_ids"):
        kernels.compute_logprobs(x, torch.tensor([0, 1, 50]), 3)
    with pytest.raises(ValueError, match=r"invalid logits .* rows \[1\]"):
        kernels.compute_logprobs(x, torch.tensor([0, 1, 2]), 3)


def test_verify_words_flag_each_row():
    vocab, k = 6, 2
    q = torch.full((5, k, vocab), 1 / vocab)
    p = torch.full((5, k + 1, vocab), 1 / vocab)
    drafts = torch.zeros(5, k, dtype=torch.int64)
    num_draft = torch.tensor([2, 3, 1, 2, 2])  # row 1: above K
    temperature = torch.tensor([1.0, 1.0, -1.0, 1.0, 0.0])  # row 2: negative
    drafts[3, 1] = vocab  # row 3: a draft outside the vocabulary
    p[4, 2, 0] = float("nan")  # row 4: a NaN, at a position never read
    e = torch.zeros(5, dtype=torch.int32)
    out = kernels.verify_drafts(
        drafts, q, p, num_draft, temperature=temperature, seed=torch.arange(5), errors=e
    )
    assert e.tolist() == [
        0,
        speculative.ERROR_NUM_DRAFT,
        speculative.ERROR_TEMPERATURE,
        speculative.ERROR_DRAFT_OUTSIDE,
        speculative.ERROR_TARGET_PROBS,
    ]
    assert out.tokens[1:].eq(-1).all() and out.num_accepted[1:].eq(0).all()
    assert out.tokens[0, -1] != -1 or out.tokens[0, 0] != -1


def test_token_mask_words_flag_each_entry():
    x = torch.randn(3, 40)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    e = torch.full((3,), 7, dtype=torch.int32)
    out = kernels.apply_token_bitmask(x, bitmask, torch.tensor([1, 3, -1]), errors=e)
    assert e.tolist() == [0, token_mask.ERROR_ROW_OUT_OF_RANGE, token_mask.ERROR_ROW_OUT_OF_RANGE]
    assert torch.equal(out[[0, 2]], x[[0, 2]]) and out[1].eq(float("-inf")).all()


# ---------------------------------------------------------------- quantized_linear


def quant_call(m: int, n: int = 512, k: int = 1024, device: torch.device = META):
    x = torch.empty(m, k, dtype=torch.float16, device=device)
    q = torch.empty(n, k, dtype=torch.int8, device=device)
    s = torch.empty(n, k // 64, dtype=torch.float16, device=device)
    return lambda: kernels.quantized_linear(x, q, s, s, group_size=64, bits=8)


@pytest.mark.parametrize("m", [1, 3, 7, 8, 64])
def test_quantized_linear_unsplit_is_one_launch_and_nothing_else(m):
    """Enough output tiles: no split-K, so no partial sums to add up after the launch."""
    rec = record(quant_call(m))
    assert rec.syncs == []
    assert len(rec.launches) == 1 and rec.launches[0].grid[2] == 1
    assert rec.small_ops == []


def test_quantized_linear_split_is_one_launch_and_nothing_else():
    """Split-K reduces inside the launch (the last slice of a tile adds the slices up):
    no sum and no rounding after it. The counters are allocated once, on the first
    split call of a device."""
    call = quant_call(1, n=64, k=8192)  # 1 output tile: the interpreter's policy splits
    record(call)
    rec = record(call)
    assert rec.syncs == [] and rec.small_ops == []
    assert len(rec.launches) == 1 and rec.launches[0].grid[2] > 1


@pytest.mark.skipif(not INTERPRET, reason="runs the kernel on the CPU")
@pytest.mark.parametrize("m", [1, 9])  # the GEMV and the GEMM
def test_quantized_linear_split_sums_the_slices_in_order_and_resets_its_counters(m):
    """The split result is the unsplit one's up to the order of the sums (QUANT-TOL-1),
    the same bits call after call, and the counters are back to zero for the next."""
    generator = torch.Generator().manual_seed(0)
    n, k, group = 48, 1024, 32
    x = torch.randn(m, k, generator=generator)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, k // group, generator=generator) / 64
    zeros = torch.zeros(n, k // group)
    want = x.double() @ (scales.double().repeat_interleave(group, 1) * q.double()).T
    call = lambda: kernels.quantized_linear(x, q, scales, zeros, group_size=group, bits=8)  # noqa: E731
    assert record(call).launches[0].grid[2] > 1
    first, again = call(), call()
    torch.testing.assert_close(first.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(first, again)
    assert int(workspace._COUNTERS[x.device, 0].count_nonzero()) == 0


def test_quantized_linear_compiles_once_for_every_row_count():
    """M is not specialised: one GEMV for decode rows, one GEMM a BLOCK_M (64 from 33
    rows on: the prefill tile sizes are a choice of `_tiling`, not a specialisation)."""
    gemv = {record(quant_call(m)).launches[0].compile_key for m in (1, 2, 3, 5, 7)}
    gemm = {record(quant_call(m)).launches[0].compile_key for m in (33, 48, 64, 100)}
    assert len(gemv) == 1 and len(gemm) == 1


def test_quantized_linear_small_matrices_are_not_split_on_a_gpu():
    """The GPU policy (`_splits` on a CUDA device; no GPU needed to ask it)."""
    cuda = torch.device("cuda")
    assert quant_linear._splits(24, 640, 128, cuda)[0] == 1  # K of 5 tiles: short
    assert quant_linear._splits(quant_linear.ENOUGH_PROGRAMS, 8192, 128, cuda)[0] == 1
    assert quant_linear._splits(24, 8192, 128, cuda)[0] > 1  # few tiles, a long K
