"""Verification of speculative drafts in Triton: one program per row.

Same name, signature and semantics as `decodespec.spec.speculative.verify_drafts`
(VERIFY-ACCEPT-1 ... VERIFY-VALID-1). A program walks its row's drafts in
order: draft j passes if `U_j · q_j(x_j) < p_j(x_j)` (U from Philox stream 1
at step + j, index 0), or, for a greedy row, if it is the first argmax of
p_j (one pass over the vocabulary). The first failure stops the run. The
token after the accepted prefix is drawn by Gumbel-max over the vocabulary:
from the residual `max(p − q, 0)` at a rejection (stream 2, one pass for its
mass and one for the choice), from p after a full run (stream 0, the noise
`sample` uses), or the first argmax for a greedy row. The random numbers are
bit-identical to the spec's.

Probabilities must be float16, bfloat16 or float32 (computed in float32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import INTERPRET, check_kernel_device, check_tensor, check_vocabulary
from .sampling import _uniform

PROBS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Verification(NamedTuple):
    """What `verify_drafts` returns, per row (the spec's fields)."""

    tokens: Tensor  # [batch, K + 1] int64: accepted drafts, then one more token; −1 after
    num_accepted: Tensor  # [batch] int64


@triton.jit
def _first_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """The smallest index of the maximum of a row of `vocab` probabilities."""
    best = float("-inf")
    best_index = 0
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        p = tl.load(row_ptr + offsets, mask=offsets < vocab, other=float("-inf")).to(tl.float32)
        chunk_best = tl.max(p, axis=0)
        chunk_index = tl.min(tl.where(p == chunk_best, offsets, 2147483647), axis=0)
        best_index = tl.where(chunk_best > best, chunk_index, best_index)
        best = tl.maximum(best, chunk_best)
    return best_index


@triton.jit
def _gumbel_choice(
    p_row, q_row, vocab, seed, step, stream, SUBTRACT: tl.constexpr, BLOCK_V: tl.constexpr
):
    """argmax_i (ln w_i + G_i) over w_i > 0, w = max(p − q, 0) (SUBTRACT) or p.

    A residual with no mass at all (rounding) falls back to p (VERIFY-RESIDUAL-1).
    """
    use_residual = SUBTRACT
    if SUBTRACT:
        mass = 0.0
        for start in range(0, vocab, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            p = tl.load(p_row + offsets, mask=offsets < vocab, other=0.0).to(tl.float32)
            q = tl.load(q_row + offsets, mask=offsets < vocab, other=0.0).to(tl.float32)
            mass += tl.sum(tl.maximum(p - q, 0.0), axis=0)
        use_residual = mass > 0.0
    best = float("-inf")
    best_index = 0
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        w = tl.load(p_row + offsets, mask=offsets < vocab, other=0.0).to(tl.float32)
        if SUBTRACT:
            q = tl.load(q_row + offsets, mask=offsets < vocab, other=0.0).to(tl.float32)
            w = tl.where(use_residual, tl.maximum(w - q, 0.0), w)
        u = _uniform(seed, step, offsets, stream)
        # log of 1, not of 0, where w is 0: those tokens are out of the draw anyway
        log_w = tl.log(tl.where(w > 0.0, w, 1.0))
        score = tl.where(w > 0.0, log_w - tl.log(-tl.log(u)), float("-inf"))
        chunk_best = tl.max(score, axis=0)
        chunk_index = tl.min(tl.where(score == chunk_best, offsets, 2147483647), axis=0)
        best_index = tl.where(chunk_best > best, chunk_index, best_index)
        best = tl.maximum(best, chunk_best)
    return best_index


@triton.jit
def _verify_kernel(
    draft_tokens_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    num_draft_ptr,
    temperature_ptr,
    seed_ptr,
    step_ptr,
    tokens_ptr,
    num_accepted_ptr,
    max_drafts,
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_ptr + row)
    sampled = tl.load(temperature_ptr + row) > 0.0
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    drafts_row = draft_tokens_ptr + row * max_drafts
    q_rows = draft_probs_ptr + row * max_drafts * vocab
    p_rows = target_probs_ptr + row * (max_drafts + 1) * vocab

    # VERIFY-ACCEPT-1 / VERIFY-GREEDY-1: the accepted prefix.
    num_accepted = num_draft * 0
    accepting = num_draft > 0
    for j in range(0, max_drafts):
        if accepting & (j < num_draft):
            x = tl.load(drafts_row + j).to(tl.int64)
            if sampled:
                p_x = tl.load(p_rows + j * vocab + x).to(tl.float32)
                q_x = tl.load(q_rows + j * vocab + x).to(tl.float32)
                u = tl.max(_uniform(seed, step + j, tl.arange(0, 2) * 0, 1), axis=0)
                passes = u * q_x < p_x
            else:
                passes = x == _first_argmax(p_rows + j * vocab, vocab, BLOCK_V)
            num_accepted += passes.to(num_accepted.dtype)
            accepting = passes
            tl.store(tokens_ptr + row * (max_drafts + 1) + j, tl.where(passes, x, -1))
        else:
            tl.store(tokens_ptr + row * (max_drafts + 1) + j, -1)

    # VERIFY-RESIDUAL-1 / VERIFY-BONUS-1: the token after the prefix.
    position = num_accepted.to(tl.int64)
    p_row = p_rows + position * vocab
    if sampled:
        if position < num_draft:
            next_token = _gumbel_choice(
                p_row, q_rows + position * vocab, vocab, seed, step + position, 2, True, BLOCK_V
            )
        else:
            next_token = _gumbel_choice(
                p_row, p_row, vocab, seed, step + position, 0, False, BLOCK_V
            )
    else:
        next_token = _first_argmax(p_row, vocab, BLOCK_V)
    tl.store(tokens_ptr + row * (max_drafts + 1) + position, next_token.to(tl.int64))
    tl.store(tokens_ptr + row * (max_drafts + 1) + max_drafts, -1, mask=position < max_drafts)
    tl.store(num_accepted_ptr + row, position)


def _check_types(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor | None,
) -> None:
    """VERIFY-VALID-1: every tensor argument is a tensor (`seed` and `step` may be None)."""
    for name, t in (
        ("draft_tokens", draft_tokens),
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
        ("num_draft", num_draft),
        ("temperature", temperature),
        ("seed", seed),
        ("step", step),
    ):
        if t is not None or name not in ("seed", "step"):
            check_tensor(name, t)


def _check(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor,
) -> None:
    """VERIFY-VALID-1: every check before the launch, each error naming the argument
    (on arguments that passed `_check_types`)."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [batch, K], got {list(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must have an integer dtype, got {draft_tokens.dtype}")
    if target_probs.dim() != 3:
        raise ValueError(
            f"target_probs must have shape [batch, K + 1, vocab], got {list(target_probs.shape)}"
        )
    vocab = check_vocabulary("target_probs", target_probs)
    for name, t, shape in (
        ("target_probs", target_probs, [batch, k + 1, vocab]),
        ("draft_probs", draft_probs, [batch, k, vocab]),
    ):
        if list(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
        if t.dtype not in PROBS_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{name} must hold finite probabilities >= 0")
    for name, t in (("num_draft", num_draft), ("step", step), ("seed", seed)):
        if t is None:
            continue
        if list(t.shape) != [batch]:
            raise ValueError(f"{name} must have shape [{batch}], got {list(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if list(temperature.shape) != [batch]:
        raise ValueError(f"temperature must have shape [{batch}], got {list(temperature.shape)}")
    if bool(((num_draft < 0) | (num_draft > k)).any()):
        raise ValueError(f"num_draft must be in [0, {k}], got {num_draft.tolist()}")
    if not bool((torch.isfinite(temperature) & (temperature >= 0)).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if bool((step < 0).any()):
        raise ValueError(f"step must be >= 0, got {step.tolist()}")
    if seed is None and bool((temperature > 0).any()):
        raise ValueError("seed is required when a row has temperature > 0")
    for name, t in (("draft_tokens", draft_tokens), ("target_probs", target_probs)):
        check_kernel_device(name, t)
    drafted = torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]
    outside = drafted & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(outside.any()):
        b, j = outside.nonzero()[0].tolist()
        token = int(draft_tokens[b, j])
        raise ValueError(f"draft_tokens[{b}, {j}] = {token} is not in [0, {vocab})")
    q_x = draft_probs.gather(-1, draft_tokens.clamp(0, vocab - 1).long()[..., None])[..., 0]
    impossible = drafted & (q_x == 0)
    if bool(impossible.any()):
        b, j = impossible.nonzero()[0].tolist()
        raise ValueError(
            f"draft_probs[{b}, {j}] gives the draft token {int(draft_tokens[b, j])} "
            "probability 0: the drafter cannot have drawn it"
        )


def verify_drafts(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    *,
    temperature: Tensor,
    seed: Tensor | None = None,
    step: Tensor | None = None,
) -> Verification:
    """Accept a prefix of each row's drafts and choose the token that follows it.

    Args:
        draft_tokens: `[batch, K]` int, row b's drafts in its first
            `num_draft[b]` columns (the rest is never read).
        draft_probs: `[batch, K, vocab]` float16/bfloat16/float32, the
            distribution each draft was drawn from.
        target_probs: `[batch, K + 1, vocab]`, same dtypes, the target's
            distribution at each draft position and after the last one.
        num_draft: `[batch]` int in [0, K].
        temperature: `[batch]` float >= 0; 0 makes the row greedy.
        seed: `[batch]` int64 seeds; required when a row has temperature > 0.
        step: `[batch]` int64 >= 0, tokens each row generated before its first draft.

    Returns:
        `Verification(tokens, num_accepted)`: `[batch, K + 1]` int64 emitted
        tokens padded with −1, and `[batch]` int64 accepted counts.

    Raises:
        ValueError: a wrong shape, dtype, device or value, or probabilities
            with no column; nothing is launched.
        TypeError: an argument that must be a tensor is not; nothing is launched.

    Example:
        >>> q = torch.eye(3)[[2, 0]][None]                    # drafts 2, then 0
        >>> p = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1 / 3] * 3]])
        >>> out = verify_drafts(torch.tensor([[2, 0]]), q, p, torch.tensor([2]),
        ...                     temperature=torch.tensor([1.0]), seed=torch.tensor([7]))
        >>> out.tokens.tolist(), out.num_accepted.tolist()
        ([[2, 1, -1]], [1])
    """
    _check_types(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    if step is None:
        step = torch.zeros(num_draft.shape, dtype=torch.int64, device=num_draft.device)
    _check(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = draft_tokens.device
    tokens = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return Verification(tokens, num_accepted)
    if seed is None:  # every row is greedy: no random number is read
        seed = torch.zeros(batch, dtype=torch.int64, device=device)
    _verify_kernel[(batch,)](
        draft_tokens.to(torch.int64).contiguous(),
        # A [batch, 0, vocab] tensor has no storage to point at: any pointer will do.
        draft_probs.contiguous() if k > 0 else target_probs,
        target_probs.contiguous(),
        num_draft.to(torch.int64),
        temperature.to(torch.float32),
        seed.to(torch.int64),
        step.to(torch.int64),
        tokens,
        num_accepted,
        k,
        vocab,
        BLOCK_V=min(triton.next_power_of_2(vocab), 4096 if INTERPRET else 1024),
        num_warps=4,
    )
    return Verification(tokens, num_accepted)
