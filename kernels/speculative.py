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

No host sync on the hot path: the kernel checks the values (VERIFY-VALID-1) and
writes an error word per row; a draft token outside the vocabulary or a
num_draft outside [0, K] is masked or clamped, never read through
(kernels.checks, "error words").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import (
    INTERPRET,
    check_kernel_device,
    check_tensor,
    check_vocabulary,
    error_words,
    raise_for_errors,
)
from .sampling import _uniform

PROBS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Dtypes the kernel loads as they are and converts itself, exactly as `.to` would.
KERNEL_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
KERNEL_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The bits of a row's error word (`errors=`); 0: the row is fine.
ERROR_DRAFT_PROBS = 1  # a draft probability of the row NaN, infinite or < 0
ERROR_TARGET_PROBS = 2  # a target probability of the row NaN, infinite or < 0
ERROR_NUM_DRAFT = 4  # num_draft outside [0, K]
ERROR_TEMPERATURE = 8  # temperature NaN, infinite or < 0
ERROR_STEP = 16  # step < 0
ERROR_SEED_REQUIRED = 32  # temperature > 0 and no seed
ERROR_DRAFT_OUTSIDE = 64  # a drafted token outside [0, vocab)
ERROR_DRAFT_IMPOSSIBLE = 128  # a drafted token of draft probability 0


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


# The ints are not specialised (Triton would compile a variant for 1 and for multiples
# of 16): one compiled kernel serves every vocabulary, draft count and batch.
@triton.jit(do_not_specialize=["max_drafts", "vocab", "drafts_stride", "drafts_column_stride"])
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
    errors_ptr,
    max_drafts,
    vocab,
    drafts_stride,
    drafts_column_stride,
    HAS_SEED: tl.constexpr,
    HAS_STEP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_CHECK: tl.constexpr,
    BLOCK_DRAFTS: tl.constexpr,
    DRAFT_PROBS: tl.constexpr,
    TARGET_PROBS: tl.constexpr,
    NUM_DRAFT: tl.constexpr,
    TEMPERATURE: tl.constexpr,
    STEP: tl.constexpr,
    SEED_REQUIRED: tl.constexpr,
    DRAFT_OUTSIDE: tl.constexpr,
    DRAFT_IMPOSSIBLE: tl.constexpr,
):
    """One row: check its values (VERIFY-VALID-1) and write its error word, then, if it
    is 0, accept a prefix of its drafts and choose the token after it. A flagged row
    emits no token (−1 everywhere, 0 accepted) and reads nothing through its values."""
    row = tl.program_id(0).to(tl.int64)
    drafts_row = draft_tokens_ptr + row * drafts_stride
    q_rows = draft_probs_ptr + row * max_drafts * vocab
    p_rows = target_probs_ptr + row * (max_drafts + 1) * vocab
    tokens_row = tokens_ptr + row * (max_drafts + 1)

    # The per-row parameters, loaded in their own dtypes and checked before any use.
    num_draft = tl.load(num_draft_ptr + row).to(tl.int64)
    error = tl.where((num_draft < 0) | (num_draft > max_drafts), NUM_DRAFT, 0)
    num_draft = tl.minimum(tl.maximum(num_draft, 0), max_drafts)  # an index: clamped
    temperature = tl.load(temperature_ptr + row)
    # NaN fails both comparisons.
    error |= tl.where((temperature >= 0) & (temperature < float("inf")), 0, TEMPERATURE)
    # Greedy or sampled as the float32 temperature says (the spec's dtype).
    sampled = temperature.to(tl.float32) > 0.0
    if HAS_STEP:
        step = tl.load(step_ptr + row).to(tl.int64)
        error |= tl.where(step < 0, STEP, 0)
    else:
        step = tl.zeros((), tl.int64)
    if HAS_SEED:
        seed = tl.load(seed_ptr + row).to(tl.int64)
    else:  # every row must be greedy: no random number is read
        seed = tl.zeros((), tl.int64)
        error |= tl.where(sampled, SEED_REQUIRED, 0)

    # Every probability of the row finite and >= 0, read or not (VERIFY-VALID-1): the
    # row's (K + 1) · vocab target and K · vocab draft probabilities are contiguous, so
    # one flat pass covers them whatever K and vocab are (NaN fails both comparisons).
    bad_p = 0
    bad_q = 0
    for start in range(0, (max_drafts + 1) * vocab, BLOCK_CHECK):
        offsets = start + tl.arange(0, BLOCK_CHECK)
        p = tl.load(p_rows + offsets, mask=offsets < (max_drafts + 1) * vocab, other=0.0)
        q = tl.load(q_rows + offsets, mask=offsets < max_drafts * vocab, other=0.0)
        p = p.to(tl.float32)
        q = q.to(tl.float32)
        bad_p += tl.sum((~((p >= 0.0) & (p < float("inf")))).to(tl.int32), axis=0)
        bad_q += tl.sum((~((q >= 0.0) & (q < float("inf")))).to(tl.int32), axis=0)
    error |= tl.where(bad_p > 0, TARGET_PROBS, 0) | tl.where(bad_q > 0, DRAFT_PROBS, 0)
    # Every drafted token inside the vocabulary, with q > 0 (the drafter drew it); a
    # token outside is masked, never used as an offset.
    outside = 0
    impossible = 0
    for j0 in range(0, max_drafts, BLOCK_DRAFTS):
        j = j0 + tl.arange(0, BLOCK_DRAFTS)
        drafted = j < num_draft
        x = tl.load(drafts_row + j * drafts_column_stride, mask=drafted, other=0).to(tl.int64)
        x_in = (x >= 0) & (x < vocab)
        q_x = tl.load(q_rows + j * vocab + x, mask=drafted & x_in, other=1.0)
        outside += tl.sum((drafted & ~x_in).to(tl.int32), axis=0)
        impossible += tl.sum((drafted & x_in & (q_x == 0)).to(tl.int32), axis=0)
    error |= tl.where(outside > 0, DRAFT_OUTSIDE, 0) | tl.where(impossible > 0, DRAFT_IMPOSSIBLE, 0)
    tl.store(errors_ptr + row, error.to(tl.int32))

    if error != 0:
        for j in range(0, max_drafts + 1):
            tl.store(tokens_row + j, -1)
        tl.store(num_accepted_ptr + row, 0)
    else:
        # VERIFY-ACCEPT-1 / VERIFY-GREEDY-1: the accepted prefix.
        num_accepted = num_draft * 0
        accepting = num_draft > 0
        for j in range(0, max_drafts):
            if accepting & (j < num_draft):
                x = tl.load(drafts_row + j * drafts_column_stride).to(tl.int64)
                if sampled:
                    p_x = tl.load(p_rows + j * vocab + x).to(tl.float32)
                    q_x = tl.load(q_rows + j * vocab + x).to(tl.float32)
                    u = tl.max(_uniform(seed, step + j, tl.arange(0, 2) * 0, 1), axis=0)
                    passes = u * q_x < p_x
                else:
                    passes = x == _first_argmax(p_rows + j * vocab, vocab, BLOCK_V)
                num_accepted += passes.to(num_accepted.dtype)
                accepting = passes
                tl.store(tokens_row + j, tl.where(passes, x, -1))
            else:
                tl.store(tokens_row + j, -1)

        # VERIFY-RESIDUAL-1 / VERIFY-BONUS-1: the token after the prefix.
        position = num_accepted.to(tl.int64)
        p_row = p_rows + position * vocab
        if sampled:
            if position < num_draft:
                next_token = _gumbel_choice(
                    p_row, q_rows + position * vocab, vocab, seed, step + position, 2, True,
                    BLOCK_V,
                )  # fmt: skip
            else:
                next_token = _gumbel_choice(
                    p_row, p_row, vocab, seed, step + position, 0, False, BLOCK_V
                )
        else:
            next_token = _first_argmax(p_row, vocab, BLOCK_V)
        tl.store(tokens_row + position, next_token.to(tl.int64))
        tl.store(tokens_row + max_drafts, -1, mask=position < max_drafts)
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


def _is_integer(t: Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _check(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor | None,
) -> None:
    """VERIFY-VALID-1: what the host knows without reading the device (shapes, dtypes,
    devices), each error naming the argument (on arguments that passed `_check_types`).
    The values are the kernel's to check (`_explain` names them)."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [batch, K], got {list(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if not _is_integer(draft_tokens):
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
    for name, t in (("num_draft", num_draft), ("step", step), ("seed", seed)):
        if t is None:
            continue
        if list(t.shape) != [batch]:
            raise ValueError(f"{name} must have shape [{batch}], got {list(t.shape)}")
        if not _is_integer(t):
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if list(temperature.shape) != [batch]:
        raise ValueError(f"temperature must have shape [{batch}], got {list(temperature.shape)}")
    if temperature.dtype.is_complex:
        raise ValueError(f"temperature must be real, got {temperature.dtype}")
    for name, t in (("draft_tokens", draft_tokens), ("target_probs", target_probs)):
        check_kernel_device(name, t)
    # One device for every tensor: a pointer to another device's memory is no pointer.
    for name, t in (
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
        ("num_draft", num_draft),
        ("temperature", temperature),
        ("seed", seed),
        ("step", step),
    ):
        if t is not None and t.device != draft_tokens.device:
            raise ValueError(f"{name} is on {t.device}, draft_tokens on {draft_tokens.device}")


def _explain(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor | None,
) -> None:
    """The failing path (it reads the device): the value error the words report, named
    as the checks before the launch used to name it (VERIFY-VALID-1)."""
    k = draft_tokens.shape[1]
    vocab = target_probs.shape[-1]
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if not bool((torch.isfinite(t) & (t >= 0)).all()):
            raise ValueError(f"{name} must hold finite probabilities >= 0")
    if bool(((num_draft < 0) | (num_draft > k)).any()):
        raise ValueError(f"num_draft must be in [0, {k}], got {num_draft.tolist()}")
    if not bool((torch.isfinite(temperature) & (temperature >= 0)).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if step is not None and bool((step < 0).any()):
        raise ValueError(f"step must be >= 0, got {step.tolist()}")
    if seed is None and bool((temperature.to(torch.float32) > 0).any()):
        raise ValueError("seed is required when a row has temperature > 0")
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


def _loadable(t: Tensor, dtypes: tuple, fallback: torch.dtype) -> Tensor:
    """`t` if the kernel loads its dtype (and converts in registers, exactly as the
    conversion here would); else `t` converted to `fallback`, one small operation."""
    return t if t.dtype in dtypes else t.to(fallback)


def verify_drafts(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    *,
    temperature: Tensor,
    seed: Tensor | None = None,
    step: Tensor | None = None,
    errors: Tensor | None = None,
) -> Verification:
    """Accept a prefix of each row's drafts and choose the token that follows it.

    Args:
        draft_tokens: `[batch, K]` int, row b's drafts in its first
            `num_draft[b]` columns (the rest is never read); any strides.
        draft_probs: `[batch, K, vocab]` float16/bfloat16/float32, the
            distribution each draft was drawn from.
        target_probs: `[batch, K + 1, vocab]`, same dtypes, the target's
            distribution at each draft position and after the last one.
        num_draft: `[batch]` int in [0, K].
        temperature: `[batch]` float >= 0; 0 makes the row greedy (as a float32).
        seed: `[batch]` int seeds; required when a row has temperature > 0.
        step: `[batch]` int >= 0, tokens each row generated before its first draft
            (None: 0).
        errors: optional `[batch]` int32, written with each row's error word: 0, or
            the `ERROR_*` bits of this module. Given, the call never reads the
            device and raises nothing for a value: the caller reads the words when
            it chooses. A flagged row emits −1 everywhere and accepts 0 drafts.

    Returns:
        `Verification(tokens, num_accepted)`: `[batch, K + 1]` int64 emitted
        tokens padded with −1, and `[batch]` int64 accepted counts.

    Raises:
        ValueError: a wrong shape, dtype or device, or probabilities with no
            column (nothing is launched); without `errors`, a wrong value (a
            probability, num_draft, temperature, step, a missing seed, a draft
            outside the vocabulary or of probability 0), after the launch.
        TypeError: an argument that must be a tensor is not; nothing is launched.

    Contract (tests/kernels/test_contracts_logprobs_verify.py): with `errors`,
    0 host syncs, 1 launch, 0 other device operations (plus 1 conversion for
    each of num_draft, seed, step of a dtype other than int8/16/32/64 and
    uint8, temperature of a non-float dtype, and a copy for non-contiguous
    probabilities). Without it: 1 sync (`raise_for_errors`) and 1 more operation
    (the words' clearing). One compiled kernel per dtypes and BLOCK_V, whatever
    the batch and vocabulary. The kernel reads every probability once to check
    it, then what the verification reads.

    Example:
        >>> q = torch.eye(3)[[2, 0]][None]                    # drafts 2, then 0
        >>> p = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1 / 3] * 3]])
        >>> out = verify_drafts(torch.tensor([[2, 0]]), q, p, torch.tensor([2]),
        ...                     temperature=torch.tensor([1.0]), seed=torch.tensor([7]))
        >>> out.tokens.tolist(), out.num_accepted.tolist()
        ([[2, 1, -1]], [1])
    """
    _check_types(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    _check(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = draft_tokens.device
    words = error_words(errors, batch, device)  # zeroed when the caller gives none
    tokens = torch.empty(batch, k + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return Verification(tokens, num_accepted)
    # Absent seed and step: HAS_SEED / HAS_STEP off, any pointer passed (never read).
    _verify_kernel[(batch,)](
        _loadable(draft_tokens, KERNEL_INT_DTYPES, torch.int64),
        # A [batch, 0, vocab] tensor has no storage to point at: any pointer will do.
        draft_probs.contiguous() if k > 0 else target_probs,
        target_probs.contiguous(),
        _loadable(num_draft, KERNEL_INT_DTYPES, torch.int64),
        _loadable(temperature, KERNEL_FLOAT_DTYPES, torch.float32),
        words if seed is None else _loadable(seed, KERNEL_INT_DTYPES, torch.int64),
        words if step is None else _loadable(step, KERNEL_INT_DTYPES, torch.int64),
        tokens,
        num_accepted,
        words,
        k,
        vocab,
        draft_tokens.stride(0),
        draft_tokens.stride(1),
        HAS_SEED=seed is not None,
        HAS_STEP=step is not None,
        BLOCK_V=min(triton.next_power_of_2(vocab), 4096 if INTERPRET else 1024),
        # A fixed block for the flat check and the drafts: one compiled kernel for any
        # K and vocabulary.
        BLOCK_CHECK=4096 if INTERPRET else 1024,
        BLOCK_DRAFTS=16,
        DRAFT_PROBS=ERROR_DRAFT_PROBS,
        TARGET_PROBS=ERROR_TARGET_PROBS,
        NUM_DRAFT=ERROR_NUM_DRAFT,
        TEMPERATURE=ERROR_TEMPERATURE,
        STEP=ERROR_STEP,
        SEED_REQUIRED=ERROR_SEED_REQUIRED,
        DRAFT_OUTSIDE=ERROR_DRAFT_OUTSIDE,
        DRAFT_IMPOSSIBLE=ERROR_DRAFT_IMPOSSIBLE,
        num_warps=4,
    )
    if errors is None:
        raise_for_errors(
            words,
            lambda: _explain(
                draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step
            ),
        )
    return Verification(tokens, num_accepted)
