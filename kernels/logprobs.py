"""Logprobs in Triton: the log-probability, rank and top-n of chosen tokens.

Same name, signature and semantics as `decodespec.spec.sampling.compute_logprobs`
(LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1). One program owns one row:
a pass for the maximum and validity, one for the log of the normaliser, one
for the rank (`1 + #{j : lp_j > lp_token}`), then n selection passes for the
top list (value descending, ties to the smaller id) — no sorting.

No host sync on the hot path: the kernel checks the values (a token id in the
vocabulary, a valid row) and writes an error word per row; an id outside the
vocabulary is masked, never read through (kernels.checks, "error words").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import INTERPRET, check_logits, check_tensor, error_words, raise_for_errors

MAX_TOP_LOGPROBS = 20

# The bits of a row's error word (`errors=`); 0: the row is fine.
ERROR_TOKEN_OUT_OF_RANGE = 1  # token_ids[row] outside [0, vocab)
ERROR_INVALID_LOGITS = 2  # a NaN or +inf in the row, or every logit −inf
# Token id dtypes the kernel loads as they are (and widens to int64 itself).
KERNEL_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class Logprobs(NamedTuple):
    """What `compute_logprobs` returns, per row (the spec's fields)."""

    token_logprobs: Tensor  # [batch] float32
    ranks: Tensor  # [batch] int64, 1 = most likely
    top_token_ids: Tensor  # [batch, n] int64
    top_logprobs: Tensor  # [batch, n] float32


# `vocab`, `logits_stride` and `num_top` are not specialised (Triton would compile a
# variant for 1 and for multiples of 16): one compiled kernel serves every vocabulary
# and batch.
@triton.jit(do_not_specialize=["vocab", "logits_stride", "num_top"])
def _logprobs_kernel(
    logits_ptr,
    token_ids_ptr,
    errors_ptr,
    token_logprobs_ptr,
    ranks_ptr,
    top_ids_ptr,
    top_logprobs_ptr,
    vocab,
    logits_stride,
    num_top,
    BLOCK_V: tl.constexpr,
    TOKEN_OUT_OF_RANGE: tl.constexpr,
    INVALID_LOGITS: tl.constexpr,
):
    """One row: log_softmax of the chosen token, its rank, the top `num_top` (LOGPROB-*).

    Writes the row's error word: TOKEN_OUT_OF_RANGE, INVALID_LOGITS (NaN, +inf or all
    −inf), or 0. A flagged row reads no logit through its token id and gets the
    placeholders NaN, rank 0, top ids −1 and top logprobs NaN.
    """
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    bad = 0
    z_max = float("-inf")
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        z = tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf"))
        z = z.to(tl.float32)
        bad += tl.sum(((z != z) | (z == float("inf"))).to(tl.int32), axis=0)
        z_max = tl.maximum(z_max, tl.max(z, axis=0))
    valid = (bad == 0) & (z_max > float("-inf"))
    # The id in its own dtype, widened here: an id outside the vocabulary is flagged,
    # never used as an offset.
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    token_ok = (token >= 0) & (token < vocab)
    error = tl.where(token_ok, 0, TOKEN_OUT_OF_RANGE) | tl.where(valid, 0, INVALID_LOGITS)
    tl.store(errors_ptr + row, error.to(tl.int32))
    top_ids_row = top_ids_ptr + row * num_top
    top_logprobs_row = top_logprobs_ptr + row * num_top
    if error == 0:
        total = 0.0
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            z = tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf"))
            total += tl.sum(tl.exp(z.to(tl.float32) - z_max), axis=0)
        log_total = tl.log(total)
        # lp_i = (z_i − max z) − ln Σ exp(z_j − max z), computed alike for every i (SOFTMAX-LOG-1)
        token_z = tl.load(logits_row + token, mask=token_ok, other=0.0)
        token_lp = (token_z.to(tl.float32) - z_max) - log_total
        tl.store(token_logprobs_ptr + row, token_lp)
        above = 0
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            z = tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf"))
            lp = (z.to(tl.float32) - z_max) - log_total
            above += tl.sum((lp > token_lp).to(tl.int32), axis=0)
        tl.store(ranks_ptr + row, above.to(tl.int64) + 1)

        # Top n: n passes, each taking the next (value descending, id ascending).
        previous_lp = float("inf")
        previous_id = -1
        for t in range(0, num_top):
            best = float("-inf")
            best_id = 2147483647
            for start in range(0, vocab, BLOCK_V):
                offsets = start + tl.arange(0, BLOCK_V)
                z = tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf"))
                lp = (z.to(tl.float32) - z_max) - log_total
                after = (lp < previous_lp) | ((lp == previous_lp) & (offsets > previous_id))
                candidate = after & (offsets < vocab)
                chunk_best = tl.max(tl.where(candidate, lp, float("-inf")), axis=0)
                chunk_id = tl.min(
                    tl.where(candidate & (lp == chunk_best), offsets, 2147483647), axis=0
                )
                better = (chunk_best > best) | ((chunk_best == best) & (chunk_id < best_id))
                best_id = tl.where(better, chunk_id, best_id)
                best = tl.maximum(best, chunk_best)
            tl.store(top_ids_row + t, best_id.to(tl.int64))
            tl.store(top_logprobs_row + t, best)
            previous_lp = best
            previous_id = best_id
    else:
        # Defined placeholders, so that a caller reading the words later never sees
        # stale memory: NaN, the impossible rank 0, no top token.
        tl.store(token_logprobs_ptr + row, float("nan"))
        tl.store(ranks_ptr + row, 0)
        for t in range(0, num_top):
            tl.store(top_ids_row + t, -1)
            tl.store(top_logprobs_row + t, float("nan"))


def _check_arguments(logits: Tensor, token_ids: Tensor, num_top: int) -> None:
    """What the host knows without reading the device: types, shapes, dtypes, devices, n."""
    check_logits(logits)
    check_tensor("token_ids", token_ids)
    if list(token_ids.shape) != [logits.shape[0]]:
        raise ValueError(
            f"token_ids must have shape [{logits.shape[0]}], got {list(token_ids.shape)}"
        )
    if (
        token_ids.dtype.is_floating_point
        or token_ids.dtype.is_complex
        or token_ids.dtype == torch.bool
    ):
        raise ValueError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
    if token_ids.device != logits.device:
        raise ValueError(f"token_ids is on {token_ids.device}, logits on {logits.device}")
    if not isinstance(num_top, int) or isinstance(num_top, bool):
        raise ValueError(f"num_top must be an integer, got {num_top!r}")
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")


def _explain(logits: Tensor, token_ids: Tensor, errors: Tensor) -> None:
    """The failing path (it reads the device): the error the words report, named as the
    checks before the launch used to name it."""
    vocab = logits.shape[-1]
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {token_ids.tolist()}")
    bad = (errors & ERROR_INVALID_LOGITS) != 0
    if bool(bad.any()):
        raise ValueError(
            f"invalid logits (NaN, +inf or all -inf) in rows {bad.nonzero().flatten().tolist()}"
        )


def compute_logprobs(
    logits: Tensor, token_ids: Tensor, num_top: int = 0, *, errors: Tensor | None = None
) -> Logprobs:
    """Log-probability, rank and top-n alternatives of chosen tokens (spec.sampling).

    (LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1.) Raw logits give raw
    logprobs; the output of `process_logits` gives processed ones.

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32; rows must be valid.
        token_ids: `[batch]` int, the chosen tokens, in [0, vocab).
        num_top: n in [0, 20]; the top list is found by n selection passes
            (value descending, ties to the smaller id), not by sorting.
        errors: optional `[batch]` int32, written with each row's error word:
            0, or `ERROR_TOKEN_OUT_OF_RANGE` | `ERROR_INVALID_LOGITS`. Given, the
            call never reads the device and raises nothing for a value: the
            caller reads the words when it chooses. A flagged row's outputs are
            NaN, rank 0, top ids −1 and top logprobs NaN.

    Returns:
        `Logprobs` (float32 log-probabilities, int64 ranks and ids).

    Raises:
        ValueError: wrong shapes, dtypes or devices, or n out of range (before
            the launch); without `errors`, a token id outside the vocabulary or
            an invalid row (NaN, +inf or all −inf), after it.

    Contract (tests/kernels/test_contracts_logprobs_verify.py): with `errors`,
    0 host syncs, 1 launch, 0 other device operations (token ids of a dtype
    other than int8/16/32/64 and uint8: 1, their conversion; non-contiguous
    logits rows: 1, a copy). Without it: 1 sync (`raise_for_errors`) and 1
    more operation (the words' clearing). One compiled kernel per logits
    dtype, token id dtype and BLOCK_V, whatever the batch and vocabulary.

    Example:
        >>> lp = compute_logprobs(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([0]), 2)
        >>> lp.ranks, lp.top_token_ids
        (tensor([3]), tensor([[1, 2]]))
    """
    _check_arguments(logits, token_ids, num_top)
    batch, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    words = error_words(errors, batch, device)  # zeroed when the caller gives none
    token_logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    ranks = torch.empty(batch, dtype=torch.int64, device=device)
    top_ids = torch.empty(batch, num_top, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(batch, num_top, dtype=torch.float32, device=device)
    if batch > 0:
        _logprobs_kernel[(batch,)](
            logits,
            # The kernel widens the id it loads; other dtypes are converted here.
            token_ids if token_ids.dtype in KERNEL_ID_DTYPES else token_ids.to(torch.int64),
            words,
            token_logprobs,
            ranks,
            top_ids,
            top_logprobs,
            vocab,
            logits.stride(0),
            num_top,
            BLOCK_V=min(triton.next_power_of_2(vocab), 4096 if INTERPRET else 1024),
            TOKEN_OUT_OF_RANGE=ERROR_TOKEN_OUT_OF_RANGE,
            INVALID_LOGITS=ERROR_INVALID_LOGITS,
            num_warps=4,
            enable_fp_fusion=False,
        )
    if errors is None:
        raise_for_errors(words, lambda: _explain(logits, token_ids, words))
    return Logprobs(token_logprobs, ranks, top_ids, top_logprobs)
