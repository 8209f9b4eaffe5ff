"""Logprobs in Triton: the log-probability, rank and top-n of chosen tokens.

Same name, signature and semantics as `decodespec.spec.sampling.compute_logprobs`
(LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1). One program owns one row:
a pass for the maximum and validity, one for the log of the normaliser, one
for the rank (`1 + #{j : lp_j > lp_token}`), then n selection passes for the
top list (value descending, ties to the smaller id) — no sorting.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import INTERPRET, check_logits, check_tensor

MAX_TOP_LOGPROBS = 20


class Logprobs(NamedTuple):
    """What `compute_logprobs` returns, per row (the spec's fields)."""

    token_logprobs: Tensor  # [batch] float32
    ranks: Tensor  # [batch] int64, 1 = most likely
    top_token_ids: Tensor  # [batch, n] int64
    top_logprobs: Tensor  # [batch, n] float32


@triton.jit
def _logprobs_kernel(
    logits_ptr,
    token_ids_ptr,
    valid_ptr,
    token_logprobs_ptr,
    ranks_ptr,
    top_ids_ptr,
    top_logprobs_ptr,
    vocab,
    logits_stride,
    num_top,
    BLOCK_V: tl.constexpr,
):
    """One row: log_softmax of the chosen token, its rank, the top `num_top` (LOGPROB-*)."""
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
    tl.store(valid_ptr + row, valid.to(tl.int8))
    if valid:
        total = 0.0
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            z = tl.load(logits_row + offsets, mask=offsets < vocab, other=float("-inf"))
            total += tl.sum(tl.exp(z.to(tl.float32) - z_max), axis=0)
        log_total = tl.log(total)
        token = tl.load(token_ids_ptr + row)
        # lp_i = (z_i − max z) − ln Σ exp(z_j − max z), computed alike for every i (SOFTMAX-LOG-1)
        token_lp = (tl.load(logits_row + token).to(tl.float32) - z_max) - log_total
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
            tl.store(top_ids_ptr + row * num_top + t, best_id.to(tl.int64))
            tl.store(top_logprobs_ptr + row * num_top + t, best)
            previous_lp = best
            previous_id = best_id


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int = 0) -> Logprobs:
    """Log-probability, rank and top-n alternatives of chosen tokens (spec.sampling).

    (LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1.) Raw logits give raw
    logprobs; the output of `process_logits` gives processed ones.

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32; rows must be valid.
        token_ids: `[batch]` int, the chosen tokens.
        num_top: n in [0, 20]; the top list is found by n selection passes
            (value descending, ties to the smaller id), not by sorting.

    Returns:
        `Logprobs` (float32 log-probabilities, int64 ranks and ids).

    Raises:
        ValueError: wrong shapes, a token id outside the vocabulary, n out of
            range, or an invalid row (NaN, +inf or all −inf).

    Example:
        >>> lp = compute_logprobs(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([0]), 2)
        >>> lp.ranks, lp.top_token_ids
        (tensor([3]), tensor([[1, 2]]))
    """
    check_logits(logits)
    check_tensor("token_ids", token_ids)
    if list(token_ids.shape) != [logits.shape[0]]:
        raise ValueError(
            f"token_ids must have shape [{logits.shape[0]}], got {list(token_ids.shape)}"
        )
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids must have an integer dtype, got {token_ids.dtype}")
    if token_ids.device != logits.device:
        raise ValueError(f"token_ids is on {token_ids.device}, logits on {logits.device}")
    if not isinstance(num_top, int) or isinstance(num_top, bool):
        raise ValueError(f"num_top must be an integer, got {num_top!r}")
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"num_top must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    batch, vocab = logits.shape
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {token_ids.tolist()}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    valid = torch.empty(batch, dtype=torch.int8, device=device)
    token_logprobs = torch.empty(batch, dtype=torch.float32, device=device)
    ranks = torch.empty(batch, dtype=torch.int64, device=device)
    top_ids = torch.empty(batch, num_top, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(batch, num_top, dtype=torch.float32, device=device)
    if batch > 0:
        _logprobs_kernel[(batch,)](
            logits,
            token_ids.to(torch.int64),
            valid,
            token_logprobs,
            ranks,
            top_ids,
            top_logprobs,
            vocab,
            logits.stride(0),
            num_top,
            BLOCK_V=min(triton.next_power_of_2(vocab), 4096 if INTERPRET else 1024),
            num_warps=4,
            enable_fp_fusion=False,
        )
    bad = valid == 0
    if bool(bad.any()):
        raise ValueError(
            f"invalid logits (NaN, +inf or all -inf) in rows {bad.nonzero().flatten().tolist()}"
        )
    return Logprobs(token_logprobs, ranks, top_ids, top_logprobs)
