"""Token mask: a grammar's packed int32 bitmask applied to the logits.

Same name, signature and semantics as `decodespec.spec.token_mask.apply_token_bitmask`
(MASK-LAYOUT-1, MASK-APPLY-1, MASK-WIDTH-1, MASK-ROWS-1, MASK-EMPTY-1,
MASK-VALID-1). One program per (row, block of BLOCK tokens) reads the
block's BLOCK / 32 words once, picks bit `t % 32` of word `t // 32` for each
token and writes the logit or −inf: a select, no arithmetic on the logits, so
the result is bit-exact in every dtype, in the Triton interpreter (bfloat16
included) as on a GPU. With `indices`, a program finds whether its row is
named by scanning `indices` (no scatter, no copy before the launch) and copies
the rows outside them, bit for bit: one launch a call.

No host sync on the hot path: the kernel checks each entry of `indices` and
writes its error word; an entry outside the batch is never an offset
(kernels.checks, "error words").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_kernel_device,
    check_tensor,
    check_vocabulary,
    error_words,
    raise_for_errors,
)

# Tokens per program: 32 words of the bitmask. A constexpr of the launch.
BLOCK_SIZE = 1024
# Entries of `indices` a program scans at a time for its own row.
BLOCK_ROWS = 256

# The bit of an entry's error word (`errors=`); 0: the entry is fine.
ERROR_ROW_OUT_OF_RANGE = 1  # indices[i] outside [0, batch)


@triton.jit
def allowed_tokens(bitmask_row, tokens, in_vocab, words):  # noqa: ANN201 (a Triton block)
    """Whether the bitmask row allows each of `tokens` (MASK-LAYOUT-1, MASK-WIDTH-1)."""
    word_index = tokens // 32
    # Tokens past the bitmask's words read the word 0: disallowed (MASK-WIDTH-1).
    word = tl.load(bitmask_row + word_index, mask=in_vocab & (word_index < words), other=0)
    # Bit t % 32 of the word, bit 0 the least significant; an arithmetic shift of a
    # negative word fills with ones, which `& 1` drops (MASK-LAYOUT-1).
    return ((word >> (tokens % 32).to(tl.int32)) & 1) != 0


# The ints are not specialised (Triton would compile a variant for 1 and for multiples
# of 16): one compiled kernel serves every batch, vocabulary and stride.
@triton.jit(
    do_not_specialize=[
        "batch",
        "num_rows",
        "vocab",
        "words",
        "logits_stride",
        "bitmask_stride",
        "out_stride",
    ]
)
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    out_ptr,
    errors_ptr,
    batch,
    num_rows,
    vocab,
    words,
    logits_stride,
    bitmask_stride,
    out_stride,
    HAS_ROWS: tl.constexpr,
    HAS_ERRORS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROW_OUT_OF_RANGE: tl.constexpr,
):
    """Program (r, b): tokens [b · BLOCK, (b + 1) · BLOCK) of row r of the output, masked
    if r is one of `rows` (every row without HAS_ROWS), else copied; and, at b = 0, the
    error word of entry r of the call's rows."""
    program = tl.program_id(0)
    if HAS_ROWS:
        # Entry `program` of `rows`: a row outside [0, batch) is reported, and never an
        # offset (rows are matched below, not indexed through).
        if (tl.program_id(1) == 0) & (program < num_rows):
            index = tl.load(rows_ptr + program).to(tl.int64)
            outside = (index < 0) | (index >= batch)
            tl.store(errors_ptr + program, tl.where(outside, ROW_OUT_OF_RANGE, 0))
        # Whether row `program` is named, by a scan of `rows` (a row named twice is
        # masked once, to the same bits); no copy of the other rows first.
        named = 0
        for start in range(0, num_rows, BLOCK_ROWS):
            entries = start + tl.arange(0, BLOCK_ROWS)
            index = tl.load(rows_ptr + entries, mask=entries < num_rows, other=-1)
            named += tl.sum((index.to(tl.int64) == program).to(tl.int32), axis=0)
        masked = named > 0
    else:
        if HAS_ERRORS:  # nothing to check: every word 0
            if tl.program_id(1) == 0:
                tl.store(errors_ptr + program, 0)
        masked = True
    row = program.to(tl.int64)
    if row < batch:  # the grid may be longer than the batch (more entries in `rows`)
        # 64-bit token offsets: row · stride can pass 2^31 for a large batch × vocabulary.
        tokens = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = tokens < vocab
        x = tl.load(logits_ptr + row * logits_stride + tokens, mask=in_vocab)
        if masked:
            allowed = allowed_tokens(bitmask_ptr + row * bitmask_stride, tokens, in_vocab, words)
            x = tl.where(allowed, x, tl.full([BLOCK], float("-inf"), x.dtype))
        tl.store(out_ptr + row * out_stride + tokens, x, mask=in_vocab)


def check_bitmask(logits: Tensor, bitmask: Tensor, name: str = "bitmask") -> None:
    """MASK-VALID-1 for a `[batch, words]` bitmask of `[batch, vocab]` logits."""
    batch = logits.shape[0]
    if bitmask.dim() != 2 or bitmask.shape[0] != batch or bitmask.shape[1] < 1:
        raise ValueError(
            f"{name} must have shape [{batch}, words] (logits' batch, words >= 1), "
            f"got {list(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"{name} must be int32 (32 tokens a word), got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"{name} is on {bitmask.device}, logits on {logits.device}")


def _check(logits: Tensor, bitmask: Tensor, indices: Tensor | None) -> None:
    """MASK-VALID-1: what the host knows without reading the device (types, shapes,
    dtypes, devices), each error naming the argument. The rows `indices` holds are the
    kernel's to check (`_explain` names them)."""
    check_tensor("logits", logits)
    check_tensor("bitmask", bitmask)
    if indices is not None:
        check_tensor("indices", indices)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must have a floating-point dtype, got {logits.dtype}")
    if logits.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"logits must be float16, bfloat16, float32 or float64 for the Triton kernel, "
            f"got {logits.dtype}"
        )
    check_vocabulary("logits", logits)
    check_bitmask(logits, bitmask)
    check_kernel_device("logits", logits)
    if indices is None:
        return
    if indices.dim() != 1 or indices.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"indices must be a 1-D int32 or int64 tensor of rows, got shape "
            f"{list(indices.shape)} and {indices.dtype}"
        )
    if indices.device != logits.device:
        raise ValueError(f"indices is on {indices.device}, logits on {logits.device}")


def _explain(batch: int, indices: Tensor) -> None:
    """The failing path (it reads the device): the row outside the batch, named as the
    check before the launch used to name it."""
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= batch:
        bad = low if low < 0 else high
        raise ValueError(f"indices holds {bad}: rows must be in [0, {batch}) (logits' batch)")


def apply_token_bitmask(
    logits: Tensor,
    bitmask: Tensor,
    indices: Tensor | None = None,
    *,
    errors: Tensor | None = None,
) -> Tensor:
    """The logits with every token the bitmask disallows at −inf.

    Args:
        logits: `[batch, vocab]` float16, bfloat16, float32 or float64 (any
            strides); not modified.
        bitmask: `[batch, words]` int32, xgrammar's and llguidance's layout:
            token t of row b is allowed iff bit `t % 32` of `bitmask[b, t // 32]`
            is 1; tokens past `32 · words` are disallowed, bits past `vocab`
            ignored.
        indices: optional `[n]` int32/int64 rows to mask; the other rows are
            returned unchanged. None masks every row.
        errors: optional `[n]` int32 (`[batch]` without indices), written with one
            word per entry of `indices`: 0, or `ERROR_ROW_OUT_OF_RANGE` for an
            entry outside [0, batch) (ignored: it masks no row). Given, the call
            never reads the device: the caller reads the words when it chooses.

    Returns:
        `[batch, vocab]` contiguous, logits' dtype: allowed entries bit for
        bit, disallowed ones −inf.

    Raises:
        ValueError: a wrong shape, dtype or device (before the launch); without
            `errors`, a row of `indices` outside the batch (after it); the message
            names the argument.
        TypeError: an argument that is not a tensor.

    Contract (tests/kernels/test_contracts_logprobs_verify.py): 1 launch (none for an
    empty batch and no indices), 0 other device operations (strided logits or bitmask
    columns: a copy each). Host syncs: 0 with `errors` or without `indices`;
    otherwise 1 (`raise_for_errors`) and 1 more operation (the words' clearing).
    One compiled kernel per logits dtype, indices dtype and HAS_* flags, whatever
    the batch, vocabulary and strides.

    Example:
        >>> logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> bitmask = torch.tensor([[0b101], [0b010]], dtype=torch.int32)
        >>> apply_token_bitmask(logits, bitmask).tolist()
        [[1.0, -inf, 3.0], [-inf, 5.0, -inf]]
    """
    _check(logits, bitmask, indices)
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    device = logits.device
    num_rows = batch if indices is None else indices.numel()
    # Without indices and without the caller's words, nothing to check or report.
    words = None if errors is None and indices is None else error_words(errors, num_rows, device)
    out = torch.empty((batch, vocab), dtype=logits.dtype, device=device)
    # One program per row of the output, masked or copied, and per entry of `indices`.
    programs = max(batch, num_rows)
    if programs > 0:
        grid = (programs, triton.cdiv(vocab, BLOCK_SIZE))
        _apply_token_bitmask_kernel[grid](
            logits,
            bitmask,
            indices if indices is not None else bitmask,  # any pointer without HAS_ROWS
            out,
            words if words is not None else bitmask,  # any pointer without HAS_ERRORS
            batch,
            num_rows,
            vocab,
            bitmask.shape[1],
            logits.stride(0),
            bitmask.stride(0),
            out.stride(0),
            HAS_ROWS=indices is not None,
            HAS_ERRORS=words is not None,
            BLOCK=BLOCK_SIZE,
            BLOCK_ROWS=BLOCK_ROWS,
            ROW_OUT_OF_RANGE=ERROR_ROW_OUT_OF_RANGE,
        )
    if errors is None and indices is not None:
        raise_for_errors(words, lambda: _explain(batch, indices))
    return out
