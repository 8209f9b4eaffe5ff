"""Weight-only quantized linear: `x · dequantize(W)ᵀ` with int4 or int8 group codes.

Same name, signature and semantics as `decodespec.spec.quant.quantized_linear`
(QUANT-GROUP-1, QUANT-CODES-1, QUANT-LINEAR-1, QUANT-TOL-1, QUANT-VALID-1):
`W[n, k] = s[n, k // G] · q[n, k] + o[n, k // G]`, the products summed in
float32 (float64 for float64 `x`), the result in `x`'s dtype.

The weights never exist dequantized in memory: each program loads a
`[BLOCK_N, BLOCK_K]` tile of codes (int4: `BLOCK_K / 2` bytes a row, the low
nibble of byte j is element 2j, the high nibble element 2j + 1), its scales and
offsets, dequantizes it in registers (`dequantize_tile`) and multiplies it
with the activations. Two kernels share that tile:

- `_quantized_gemv_kernel`, decode (few rows, and float64): one program per
  (row of `x`, block of outputs, slice of `K`); products and sums on the FMA
  units. A memory-bound GEMV needs many programs to keep every SM loading, so
  `K` is split (split-K) when the output blocks alone are too few (under
  `ENOUGH_PROGRAMS`) and K is long enough; each slice writes its partial sums to
  a float32 plane of `[splits, M, N]`, and the last slice of an output tile to
  finish (an atomic counter per tile) adds the planes up in slice order and
  writes the result (`_write`): deterministic, one launch. Small matrices, and
  grids already wide enough, are not split.
- `_quantized_gemm_kernel`, prefill (`GEMM_MIN_ROWS` rows or more): `[BLOCK_M, BLOCK_N]`
  output tiles, `tl.dot` on the tensor cores with the dequantized tile cast
  to the activation dtype (float32: `input_precision="ieee"`, no TF32).

Group scales, per K-tile: when the tile lies inside one group (`group_size` a
multiple of `BLOCK_K`), one scale and offset a row; when it holds whole groups
(`BLOCK_K` a multiple of `group_size`: 32 for Q4_1/Q8_0-like layouts), one a
group, broadcast over the group's columns; otherwise each element's group
`k // G` is gathered, which is correct for any `G` that divides `K`.
`_tiling` picks the kernel, the blocks and the branch for a call's shape.
In the Triton interpreter bfloat16 arithmetic and float32 → bfloat16 casts
are wrong: there the tiles are upcast to float32 and the result is written
in float32 and rounded by PyTorch (`UPCAST`).

Reference: the same product is `x @ dequantize_weight(...).T`; the Triton
tutorials' matmul (03-matrix-multiplication) is the GEMM's skeleton.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import FLOAT_DTYPES, INTERPRET, check_kernel_device, check_tensor
from .workspace import arrival_counters

CODE_DTYPES = {4: torch.uint8, 8: torch.int8}
# Rows of x from which the GEMM (tl.dot, at least 16 rows a tile) takes over.
GEMM_MIN_ROWS = 8


@triton.jit
def dequantize_tile(  # noqa: ANN201 (a Triton block)
    q_ptr,
    s_ptr,
    o_ptr,
    n,
    k0,
    n_valid,
    K,
    stride_qn,
    stride_sn,
    stride_on,
    group_size,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS_IN_TILE: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """The weights `W[n, k0 : k0 + BLOCK_K]` `[BLOCK_N, BLOCK_K]` in COMPUTE, 0 past `K`
    (QUANT-GROUP-1, QUANT-CODES-1). `n` is int64."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_valid = k < K
    if BITS == 4:
        # BLOCK_K / 2 bytes a row; byte j holds element 2j (low nibble) and 2j + 1 (high).
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(
            q_ptr + n[:, None] * stride_qn + byte[None, :],
            mask=n_valid[:, None] & (byte < K // 2)[None, :],
            other=0,
        ).to(tl.int32)
        codes = tl.interleave(packed & 0xF, (packed >> 4) & 0xF)
    else:
        codes = tl.load(
            q_ptr + n[:, None] * stride_qn + k[None, :],
            mask=n_valid[:, None] & k_valid[None, :],
            other=0,
        ).to(tl.int32)
    if GROUPS_IN_TILE == 1:  # the tile lies inside group k0 // G: one scale and offset a row
        group = k0 // group_size
        s = tl.load(s_ptr + n * stride_sn + group, mask=n_valid, other=0.0).to(COMPUTE)
        o = tl.load(o_ptr + n * stride_on + group, mask=n_valid, other=0.0).to(COMPUTE)
        w = codes.to(COMPUTE) * s[:, None] + o[:, None]
    elif GROUPS_IN_TILE > 1:  # whole groups of BLOCK_K / GROUPS_IN_TILE: a scale per group
        group = k0 // group_size + tl.arange(0, GROUPS_IN_TILE)
        mask = n_valid[:, None] & (group * group_size < K)[None, :]
        s = tl.load(s_ptr + n[:, None] * stride_sn + group[None, :], mask=mask, other=0.0)
        o = tl.load(o_ptr + n[:, None] * stride_on + group[None, :], mask=mask, other=0.0)
        grouped = tl.reshape(
            codes.to(COMPUTE), [BLOCK_N, GROUPS_IN_TILE, BLOCK_K // GROUPS_IN_TILE]
        )
        w = grouped * s.to(COMPUTE)[:, :, None] + o.to(COMPUTE)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    else:  # groups across tiles, of any size: each element's own group k // G
        group = k // group_size
        mask = n_valid[:, None] & k_valid[None, :]
        s = tl.load(s_ptr + n[:, None] * stride_sn + group[None, :], mask=mask, other=0.0)
        o = tl.load(o_ptr + n[:, None] * stride_on + group[None, :], mask=mask, other=0.0)
        w = codes.to(COMPUTE) * s.to(COMPUTE) + o.to(COMPUTE)
    # Columns past K: the offset would make them nonzero; x is 0 there too, but 0 · NaN.
    return tl.where(k_valid[None, :], w, 0.0)


@triton.jit
def _write(acc, out_ptr, partial_ptr, counter_ptr, offsets, mask, M, N, SPLIT: tl.constexpr):
    """Write this program's sums `acc` at `offsets` of the `[M, N]` output.

    Split (SPLIT: `tl.num_programs(2)` slices of K), each slice writes its partial sums
    to its `[M, N]` plane of `partial_ptr` and counts itself in at its output tile's
    counter; the slice that arrives last adds the planes up in slice order (the same
    bits whichever slice that is), writes the output and resets the counter for the
    next call: one launch, nothing after it."""
    if SPLIT:
        splits = tl.num_programs(2)
        plane = M.to(tl.int64) * N
        tl.store(partial_ptr + tl.program_id(2) * plane + offsets, acc, mask=mask)
        tile = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        # Every thread's stores before the count (the barrier), released with it, and
        # acquired by the last slice (acq_rel) before it reads them.
        tl.debug_barrier()
        arrived = tl.atomic_add(tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros_like(acc)
            for s in range(0, splits):
                # .cg: from L2, where the other programs' stores are, not a stale L1
                part = tl.load(partial_ptr + s * plane + offsets, mask=mask, cache_modifier=".cg")
                total += part
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(tile, 0)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


# M, the rows of x, follows the batch: not specialised (Triton would compile a variant
# for 1 and for multiples of 16), one compiled kernel for every batch.
@triton.jit(do_not_specialize=["M"])
def _quantized_gemv_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_on,
    group_size,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS_IN_TILE: tl.constexpr,
    COMPUTE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    n_valid = n < N
    acc = tl.zeros([BLOCK_N], COMPUTE)
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < k_stop, other=0.0).to(COMPUTE)
        w = dequantize_tile(
            q_ptr, s_ptr, o_ptr, n, k0, n_valid, k_stop, stride_qn, stride_sn, stride_on,
            group_size, BITS, BLOCK_N, BLOCK_K, GROUPS_IN_TILE, COMPUTE,
        )  # fmt: skip
        acc += tl.sum(w * x[None, :], axis=1)
    _write(acc, out_ptr, partial_ptr, counter_ptr, row * N + n, n_valid, M, N, SPLIT)


@triton.jit(do_not_specialize=["M"])  # as the GEMV's
def _quantized_gemm_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    o_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_on,
    group_size,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUPS_IN_TILE: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_valid = m < M
    n_valid = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :],
            mask=m_valid[:, None] & (k < k_stop)[None, :],
            other=0.0,
        )
        w = dequantize_tile(
            q_ptr, s_ptr, o_ptr, n, k0, n_valid, k_stop, stride_qn, stride_sn, stride_on,
            group_size, BITS, BLOCK_N, BLOCK_K, GROUPS_IN_TILE, tl.float32,
        )  # fmt: skip
        if UPCAST:  # the interpreter: float32 throughout
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # the tensor cores: the dequantized tile in x's dtype, float32 sums
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    offsets = m[:, None] * N + n[None, :]
    _write(
        acc,
        out_ptr,
        partial_ptr,
        counter_ptr,
        offsets,
        m_valid[:, None] & n_valid[None, :],
        M,
        N,
        SPLIT,
    )


def _check(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, group_size: int, bits: int
) -> tuple[int, int, int]:
    """QUANT-VALID-1: every check before the launch, each error naming the argument.

    Returns:
        `(M, N, K)`.
    """
    for name, value in (("x", x), ("qweight", qweight), ("scales", scales), ("offsets", offsets)):
        check_tensor(name, value)
    if isinstance(bits, bool) or bits not in CODE_DTYPES:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if qweight.dtype != CODE_DTYPES[bits] or qweight.dim() != 2:
        raise ValueError(
            f"qweight for bits={bits} must be a 2-D {CODE_DTYPES[bits]} tensor, "
            f"got {qweight.dtype} of shape {list(qweight.shape)}"
        )
    n, columns = qweight.shape
    k = columns * 2 if bits == 4 else columns
    if k % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide in_features {k} (qweight "
            f"{list(qweight.shape)}, bits={bits})"
        )
    for name, value in (("scales", scales), ("offsets", offsets)):
        if value.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}"
            )
        if tuple(value.shape) != (n, k // group_size):
            raise ValueError(
                f"{name} must be [out_features, in_features / group_size] = "
                f"{[n, k // group_size]}, got {list(value.shape)}"
            )
        if value.device != qweight.device:
            raise ValueError(f"{name} is on {value.device}, qweight on {qweight.device}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"x must be float16, bfloat16, float32 or float64 for the Triton kernel, got {x.dtype}"
        )
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] (in_features of qweight), got {list(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device}, qweight on {qweight.device}")
    check_kernel_device("x", x)
    return x.shape[0], n, k


class Tiling(NamedTuple):
    """The kernel and blocks one call runs with (`_tiling`)."""

    gemm: bool  # `_quantized_gemm_kernel`, else `_quantized_gemv_kernel`
    block_m: int  # rows of x a program takes: 1 for the GEMV
    block_n: int
    block_k: int
    groups_in_tile: int  # `dequantize_tile`'s branch (`_groups_in_tile`)


def _tiling(m: int, k: int, group_size: int, fp64: bool) -> Tiling:
    """The kernel, blocks and group branch for `x` `[m, k]` (float64 when `fp64`)."""
    gemm = m >= GEMM_MIN_ROWS and not fp64
    if gemm:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n, block_k = 64, 64
    else:
        block_m = 1
        block_n, block_k = (32, 64) if fp64 else (64, 128)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    return Tiling(gemm, block_m, block_n, block_k, _groups_in_tile(group_size, block_k))


def _groups_in_tile(group_size: int, block_k: int) -> int:
    """1: a K-tile lies inside one group; g > 1: it holds g whole groups; 0: groups cross
    the tiles (each element's group is gathered)."""
    if group_size % block_k == 0:
        return 1
    if block_k % group_size == 0:
        return block_k // group_size
    return 0


# No split-K once the grid over the outputs alone has this many programs: about two per
# SM of an H100 (132 SMs) keep every SM loading, and a split would cost its partial
# sums' write, read and reduction (one more operation).
ENOUGH_PROGRAMS = 128
# On a GPU a K slice is at least this many K-tiles: a shorter one hides less latency
# than its partial sums cost, so small matrices are not split at all.
MIN_K_TILES_PER_SPLIT = 4


def _split_policy(device: torch.device) -> tuple[int, int]:
    """(programs that keep the device loading, K-tiles a slice holds at least). The
    interpreter's are small, so that small test shapes split K too."""
    if device.type != "cuda":
        return 4, 1
    return ENOUGH_PROGRAMS, MIN_K_TILES_PER_SPLIT


def _splits(tiles: int, k: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(number of K slices, K per slice, a multiple of `block_k`) for `tiles` output tiles:
    1 slice when the tiles alone are enough programs or K is short."""
    k_tiles = triton.cdiv(k, block_k)
    wanted, min_k_tiles = _split_policy(device)
    splits = max(1, min(k_tiles // min_k_tiles, wanted // max(tiles, 1), 32))
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def quantized_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, *, group_size: int, bits: int
) -> Tensor:
    """`x · dequantize(W)ᵀ`, the weight-only quantized linear (QUANT-LINEAR-1).

    Args:
        x: `[M, K]` activations, float16, bfloat16, float32 or float64 (any strides).
        qweight: codes, uint8 `[N, K / 2]` (bits 4: element k in byte k // 2, the low
            nibble for even k) or int8 `[N, K]` (bits 8).
        scales, offsets: `[N, K / group_size]`, float16, bfloat16, float32 or float64.
        group_size: weights per group along `K`; it divides `K`.
        bits: 4 or 8.

    Returns:
        `[M, N]` in `x`'s dtype, accumulated in float32 (float64 for float64 x).

    Raises:
        ValueError: a wrong dtype, shape, device, group_size or bits; the message names
            the argument.
        TypeError: an argument that is not a tensor.

    Contract: 0 host syncs (every check is of shapes, dtypes and devices), 1 launch, 0
    other device operations, split or not (`_splits`: no split when the grid over the
    outputs has `ENOUGH_PROGRAMS` or K is short; split, the kernel adds the slices up).
    In the interpreter bfloat16 adds PyTorch's rounding. One compiled kernel for every
    number of rows M (two with a split, which is a function of the shape).

    Example:
        >>> q = torch.tensor([[0x31]], dtype=torch.uint8)  # codes 1 (low nibble), 3 (high)
        >>> quantized_linear(torch.tensor([[1.0, 2.0]]), q, torch.tensor([[2.0]]),
        ...                  torch.tensor([[-1.0]]), group_size=2, bits=4)
        tensor([[11.]])
    """
    m, n, k = _check(x, qweight, scales, offsets, group_size, bits)
    fp64 = x.dtype == torch.float64
    compute = torch.float64 if fp64 else torch.float32
    if m == 0 or n == 0 or k == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    # Unit stride along K (rows may have any stride); the kernels read rows with offsets.
    if x.stride(1) != 1:
        x = x.contiguous()
    qweight, scales, offsets = (
        t if t.stride(1) == 1 else t.contiguous() for t in (qweight, scales, offsets)
    )
    gemm, block_m, block_n, block_k, groups_in_tile = _tiling(m, k, group_size, fp64)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    splits, k_per_split = _splits(tiles, k, block_k, x.device)
    upcast = INTERPRET and x.dtype in (torch.float16, torch.bfloat16)
    # The interpreter's float32 -> bfloat16 cast is wrong: there the result is written
    # in float32 and PyTorch rounds it.
    rounded_here = not (INTERPRET and x.dtype == torch.bfloat16)
    out = torch.empty((m, n), dtype=x.dtype if rounded_here else compute, device=x.device)
    split = splits > 1
    partial = torch.empty((splits, m, n), dtype=compute, device=x.device) if split else out
    counters = arrival_counters(x.device, tiles) if split else out
    common = dict(
        BITS=bits,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        GROUPS_IN_TILE=groups_in_tile,
        SPLIT=split,
    )
    args = (
        x, qweight, scales, offsets, out, partial, counters, m, n, k, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), offsets.stride(0), group_size,
    )  # fmt: skip
    if gemm:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
        _quantized_gemm_kernel[grid](*args, BLOCK_M=block_m, UPCAST=upcast, **common)
    else:
        grid = (m, triton.cdiv(n, block_n), splits)
        _quantized_gemv_kernel[grid](*args, COMPUTE=tl.float64 if fp64 else tl.float32, **common)
    return out if rounded_here else out.to(x.dtype)
