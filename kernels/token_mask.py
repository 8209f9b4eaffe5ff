"""Token mask: a grammar's packed int32 bitmask applied to the logits.

Same name, signature and semantics as `decodespec.spec.token_mask.apply_token_bitmask`
(MASK-LAYOUT-1, MASK-APPLY-1, MASK-WIDTH-1, MASK-ROWS-1, MASK-EMPTY-1,
MASK-VALID-1). One program per (row, block of BLOCK tokens) reads the
block's BLOCK / 32 words once, picks bit `t % 32` of word `t // 32` for each
token and writes the logit or −inf: a select, no arithmetic on the logits, so
the result is bit-exact in every dtype, in the Triton interpreter (bfloat16
included) as on a GPU. Rows outside `indices` are copied by the wrapper and
never touched by the kernel.
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
)

# Tokens per program: 32 words of the bitmask. A constexpr of the launch.
BLOCK_SIZE = 1024


@triton.jit
def allowed_tokens(bitmask_row, tokens, in_vocab, words):  # noqa: ANN201 (a Triton block)
    """Whether the bitmask row allows each of `tokens` (MASK-LAYOUT-1, MASK-WIDTH-1)."""
    word_index = tokens // 32
    # Tokens past the bitmask's words read the word 0: disallowed (MASK-WIDTH-1).
    word = tl.load(bitmask_row + word_index, mask=in_vocab & (word_index < words), other=0)
    # Bit t % 32 of the word, bit 0 the least significant; an arithmetic shift of a
    # negative word fills with ones, which `& 1` drops (MASK-LAYOUT-1).
    return ((word >> (tokens % 32).to(tl.int32)) & 1) != 0


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    out_ptr,
    vocab,
    words,
    logits_stride,
    bitmask_stride,
    out_stride,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    # 64-bit token offsets: row · stride can pass 2^31 for a large batch × vocabulary.
    tokens = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    allowed = allowed_tokens(bitmask_ptr + row * bitmask_stride, tokens, in_vocab, words)
    x = tl.load(logits_ptr + row * logits_stride + tokens, mask=in_vocab)
    masked = tl.where(allowed, x, tl.full([BLOCK], float("-inf"), x.dtype))
    tl.store(out_ptr + row * out_stride + tokens, masked, mask=in_vocab)


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
    """MASK-VALID-1: every check before the launch, each error naming the argument."""
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
    batch = logits.shape[0]
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= batch:
            bad = low if low < 0 else high
            raise ValueError(f"indices holds {bad}: rows must be in [0, {batch}) (logits' batch)")


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None) -> Tensor:
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

    Returns:
        `[batch, vocab]` contiguous, logits' dtype: allowed entries bit for
        bit, disallowed ones −inf.

    Raises:
        ValueError: a wrong shape, dtype, device or row; the message names the
            argument.
        TypeError: an argument that is not a tensor.

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
    if indices is None:
        out = torch.empty((batch, vocab), dtype=logits.dtype, device=logits.device)
        source, rows, num_rows = logits, bitmask, batch  # `rows` is unused without HAS_ROWS
    else:
        # The rows outside `indices` are a copy; the kernel masks the others in place
        # (a row named twice is masked twice, to the same bits).
        out = torch.empty((batch, vocab), dtype=logits.dtype, device=logits.device)
        out.copy_(logits)
        source, rows, num_rows = out, indices, indices.numel()
    if num_rows == 0 or batch == 0:
        return out
    grid = (num_rows, triton.cdiv(vocab, BLOCK_SIZE))
    _apply_token_bitmask_kernel[grid](
        source,
        bitmask,
        rows,
        out,
        vocab,
        bitmask.shape[1],
        source.stride(0),
        bitmask.stride(0),
        out.stride(0),
        HAS_ROWS=indices is not None,
        BLOCK=BLOCK_SIZE,
    )
    return out
