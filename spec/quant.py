"""Weight formats: group-quantized weights and the weight-only quantized linear.

Weight-only quantization stores a projection's weights as small integer codes
with a scale and an offset per group of consecutive weights of a row; the
activations stay floating point. One affine format covers what engines run:
GGUF's Q4_0, Q4_1, Q4_K and Q8_0 blocks are instances of it (`gguf_blocks`),
so are per-channel int8 (one group per row) and the int4 group-32 layout of
PyTorch's and Marlin-style kernels. This module defines the format, the
product every fast path must compute, and the rule for quantizing float
weights.

[QUANT-GROUP-1] A group-quantized weight `W` `[N, K]` is integer codes
`q[n, k]` with, for each group `g = k // G` of `G` consecutive elements of a
row (`group_size`), a scale `s[n, g]` and an offset `o[n, g]`:
`W[n, k] = s[n, g] · q[n, k] + o[n, g]`, evaluated in float32 (float64 when
the scales are float64). `K` must be a multiple of `G`; `G = K` is one group
per row (per-channel).

[QUANT-CODES-1] `bits = 4`: unsigned codes 0 … 15, two per byte: `qweight`
is uint8 `[N, K / 2]`, element `k` in byte `k // 2`, its low nibble for even
`k` and its high nibble for odd `k`. `bits = 8`: signed codes −128 … 127,
`qweight` int8 `[N, K]`. `scales` and `offsets` are `[N, K / G]`, floating
point, on the device of `qweight`.

[QUANT-LINEAR-1] The weight-only quantized linear is
`quantized_linear(x, ...) = x · dequantize(W)ᵀ`: `x` `[M, K]` of any floating
dtype, `W` evaluated and the products accumulated in float32 (float64 for
float64 `x`), the result `[M, N]` in `x`'s dtype. Every fast path computes
this function.

[QUANT-TOL-1] Tolerance: a fast path may round differently (scales and
offsets in the activation dtype, another summation order, a different
dequantize-then-multiply split), but not more than the registry's relative
policy allows against this definition evaluated in float64 on the same codes:
`‖y − y_ref‖ / max(‖y_ref‖, ‖|x| · |W|ᵀ‖ / √K)` below 1e-5 for float32 `x`,
1e-3 for float16 and 1e-2 for bfloat16 (which admits bfloat16 scales and
offsets). The floor in the denominator is the size of the terms summed: a
sum's rounding is relative to its terms, so an output whose terms cancel is
not held to a bound no float32 sum can meet.

[QUANT-ROUND-1] Float weights are quantized (`quantize_weight`) group by
group. `bits = 4` is asymmetric, like GGUF Q4_1: `o = min(w)`,
`s = (max(w) − min(w)) / 15`, `q = clamp(round((w − o) / s), 0, 15)`.
`bits = 8` is symmetric, like GGUF Q8_0: `o = 0`, `s = max(|w|) / 127`,
`q = clamp(round(w / s), −127, 127)`. `round` is round-half-to-even; the
arithmetic is float32 (float64 for float64 weights); a group whose scale is
0 (constant for 4 bits, all zero for 8) gets codes 0, so it is restored
exactly. Non-finite weights cannot be quantized (`ValueError`).

[QUANT-A8-1] The activation-quantized linear is what GGUF engines compute for
these weights (llama.cpp multiplies Q4_0, Q4_1 and Q4_K blocks by Q8_1
activations, Q8_0 blocks by Q8_0 ones): each row of `x` is quantized in
blocks `b` of 32 consecutive elements, `d[m, b] = max|x[m, b]| / 127`,
`c[m, k] = round(x[m, k] · (1 / d[m, b]))` (float32, each operation rounded
once, round-half-to-even; a block of zeros has `d = 0` and codes 0), and
`y[m, n] = Σ_b d[m, b] · (s[n, g] · Σ_{k∈b} q[n, k] c[m, k] + o[n, g] · Σ_{k∈b} c[m, k])`,
`g` the weight group holding block `b`: the integer sums are exact, the rest
is held to QUANT-TOL-1 as a float32 fast path. `K` and `G` must be multiples
of 32 (`ValueError` otherwise). `activation_quantized_linear` defines it. It
is not QUANT-LINEAR-1's function: each activation moves by up to half a step,
`d / 2`, a 254th of its block's largest magnitude (bfloat16 moves a value by
up to a 512th of its own). llama.cpp also rounds `d` to float16: here `d` is
float32.

[QUANT-VALID-1] Every argument is checked before any arithmetic: a
non-tensor raises `TypeError` (ArgumentTypeError) naming it; a wrong dtype,
a shape that does not fit (`K` not a multiple of `group_size`, an odd `K`
for 4 bits, `scales` or
`offsets` not `[N, K / G]`, `x`'s last dimension not `K`), `bits` other than
4 or 8, `group_size` < 1 or tensors on different devices raise `ValueError`
naming the argument and what it got.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .softmax import check_tensor

QUANT_BITS = (4, 8)
CODE_DTYPES = {4: torch.uint8, 8: torch.int8}


def check_quantized(
    qweight: Tensor, scales: Tensor, offsets: Tensor, group_size: int, bits: int
) -> tuple[int, int]:
    """`(N, K)` of a group-quantized weight, or the error of QUANT-VALID-1."""
    for name, value in (("qweight", qweight), ("scales", scales), ("offsets", offsets)):
        check_tensor(name, value)
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if qweight.dtype != CODE_DTYPES[bits] or qweight.dim() != 2:
        raise ValueError(
            f"qweight for bits={bits} must be a 2-D {CODE_DTYPES[bits]} tensor, "
            f"got {qweight.dtype} of shape {list(qweight.shape)}"
        )
    rows, columns = qweight.shape
    k = columns * 2 if bits == 4 else columns
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    for name, value in (("scales", scales), ("offsets", offsets)):
        if not value.dtype.is_floating_point:
            raise ValueError(f"{name} must be floating point, got {value.dtype}")
        if tuple(value.shape) != (rows, k // group_size):
            raise ValueError(
                f"{name} must be [out_features, in_features / group_size] = "
                f"{[rows, k // group_size]}, got {list(value.shape)}"
            )
        if value.device != qweight.device:
            raise ValueError(f"{name} is on {value.device}, qweight on {qweight.device}")
    return rows, k


def unpack_codes(qweight: Tensor, bits: int) -> Tensor:
    """The integer codes `[N, K]` (int32) of `qweight` (QUANT-CODES-1)."""
    if bits == 8:
        return qweight.to(torch.int32)
    low = qweight & 0x0F
    high = qweight >> 4
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], -1).to(torch.int32)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """`qweight` of integer codes `[N, K]` (QUANT-CODES-1); the inverse of `unpack_codes`."""
    if bits == 8:
        return codes.to(torch.int8)
    pairs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def dequantize_weight(
    qweight: Tensor, scales: Tensor, offsets: Tensor, *, group_size: int, bits: int
) -> Tensor:
    """The weights `[N, K]` of a group-quantized matrix (QUANT-GROUP-1, QUANT-CODES-1).

    Returns:
        float32 `[N, K]` (float64 for float64 scales).

    Example:
        >>> q = pack_codes(torch.tensor([[0, 1, 2, 15]]), bits=4)
        >>> dequantize_weight(q, torch.tensor([[0.5, 1.0]]), torch.tensor([[-1.0, 0.0]]),
        ...                   group_size=2, bits=4)
        tensor([[-1.0000, -0.5000,  2.0000, 15.0000]])
    """
    rows, k = check_quantized(qweight, scales, offsets, group_size, bits)
    compute = torch.promote_types(scales.dtype, torch.float32)
    codes = unpack_codes(qweight, bits).to(compute).view(rows, k // group_size, group_size)
    weight = codes * scales.to(compute)[..., None] + offsets.to(compute)[..., None]
    return weight.view(rows, k)


def quantized_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, *, group_size: int, bits: int
) -> Tensor:
    """`x · dequantize(W)ᵀ`, the weight-only quantized linear (QUANT-LINEAR-1).

    Args:
        x: `[M, K]` activations, any floating dtype.
        qweight: codes, uint8 `[N, K / 2]` (bits 4) or int8 `[N, K]` (bits 8).
        scales, offsets: `[N, K / group_size]` floating point.
        group_size: weights per group along `K`.
        bits: 4 or 8.

    Returns:
        `[M, N]` in `x`'s dtype, accumulated in float32 (float64 for float64 x).

    Example:
        >>> q = pack_codes(torch.tensor([[1, 3]]), bits=4)
        >>> quantized_linear(torch.tensor([[1.0, 2.0]]), q, torch.tensor([[2.0]]),
        ...                  torch.tensor([[-1.0]]), group_size=2, bits=4)
        tensor([[11.]])
    """
    check_tensor("x", x)
    _rows, k = check_quantized(qweight, scales, offsets, group_size, bits)
    if not x.dtype.is_floating_point or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be floating point [M, {k}], got {x.dtype} {list(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device}, qweight on {qweight.device}")
    compute = torch.promote_types(x.dtype, torch.float32)
    weight = dequantize_weight(
        qweight, scales.to(compute), offsets.to(compute), group_size=group_size, bits=bits
    )
    return (x.to(compute) @ weight.T).to(x.dtype)


ACTIVATION_BLOCK = 32  # QUANT-A8-1's block of activations


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """The int8 codes `[M, K]` and float32 scales `[M, K / 32]` of float `x` `[M, K]`,
    block by block of 32 (QUANT-A8-1).

    Example:
        >>> codes, scales = quantize_activations(torch.arange(32.0)[None])
        >>> codes[0, :4].tolist(), scales.tolist()
        ([0, 4, 8, 12], [[0.24409449100494385]])
    """
    check_tensor("x", x)
    if not x.dtype.is_floating_point or x.dim() != 2 or x.shape[1] % ACTIVATION_BLOCK:
        raise ValueError(
            f"x must be floating point [M, K], K a multiple of {ACTIVATION_BLOCK}, "
            f"got {x.dtype} {list(x.shape)}"
        )
    blocks = x.float().view(x.shape[0], -1, ACTIVATION_BLOCK)
    scales = blocks.abs().amax(dim=-1) / 127
    inverse = torch.where(scales == 0, torch.zeros_like(scales), 1 / scales)
    codes = (blocks * inverse[..., None]).round()  # round half to even
    return codes.to(torch.int8).view(x.shape), scales


def activation_quantized_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, offsets: Tensor, *, group_size: int, bits: int
) -> Tensor:
    """`x` quantized to int8 blocks of 32, times `W`, the integer sums exact
    (QUANT-A8-1): what llama.cpp computes for Q4 and Q8 weights.

    Args:
        x: `[M, K]` activations, any floating dtype; `K` a multiple of 32.
        qweight, scales, offsets, bits: as `quantized_linear`.
        group_size: weights per group along `K`, a multiple of 32.

    Returns:
        `[M, N]` in `x`'s dtype, evaluated in float64.

    Example:
        >>> w = quantize_weight(torch.ones(1, 32), bits=8, group_size=32)
        >>> activation_quantized_linear(torch.ones(1, 32), w.qweight, w.scales, w.offsets,
        ...                             group_size=32, bits=8)
        tensor([[32.]])
    """
    check_tensor("x", x)
    rows, k = check_quantized(qweight, scales, offsets, group_size, bits)
    if group_size % ACTIVATION_BLOCK:
        raise ValueError(f"group_size must be a multiple of {ACTIVATION_BLOCK}, got {group_size}")
    if not x.dtype.is_floating_point or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be floating point [M, {k}], got {x.dtype} {list(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device}, qweight on {qweight.device}")
    codes_x, d = quantize_activations(x)
    blocks = k // ACTIVATION_BLOCK
    c = codes_x.double().view(-1, blocks, ACTIVATION_BLOCK)
    q = unpack_codes(qweight, bits).double().view(rows, blocks, ACTIVATION_BLOCK)
    products = torch.einsum("mbj,nbj->mnb", c, q)  # exact: |sums| < 2^53
    per_block = ACTIVATION_BLOCK * torch.arange(blocks, device=x.device) // group_size
    s, o = scales.double()[:, per_block], offsets.double()[:, per_block]  # [N, blocks]
    terms = s[None] * products + o[None] * c.sum(dim=-1)[:, None, :]
    return (d.double()[:, None, :] * terms).sum(dim=-1).to(x.dtype)


def quantize_weight(weight: Tensor, *, bits: int, group_size: int) -> QuantizedWeight:
    """Quantize float weights `[N, K]` group by group (QUANT-ROUND-1).

    Example:
        >>> w = quantize_weight(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), bits=4, group_size=4)
        >>> w.dequantize()
        tensor([[0., 1., 2., 3.]])
    """
    check_tensor("weight", weight)
    if bits not in QUANT_BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if not weight.dtype.is_floating_point or weight.dim() != 2:
        raise ValueError(
            f"weight must be a 2-D floating tensor, got {weight.dtype} {list(weight.shape)}"
        )
    rows, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    if bits == 4 and k % 2:
        raise ValueError(f"4-bit codes pack two per byte: in_features must be even, got {k}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("weight has non-finite values: they cannot be quantized")
    compute = torch.promote_types(weight.dtype, torch.float32)
    groups = weight.to(compute).view(rows, k // group_size, group_size)
    if bits == 4:
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales, offsets, top = (high - low) / 15, low, 15
    else:
        scales, offsets, top = (
            groups.abs().amax(dim=-1) / 127,
            torch.zeros_like(groups[..., 0]),
            127,
        )
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = ((groups - offsets[..., None]) / safe[..., None]).round()
    codes = torch.where(scales[..., None] == 0, torch.zeros_like(codes), codes)
    codes = codes.clamp(0 if bits == 4 else -top, top).view(rows, k)
    return QuantizedWeight(pack_codes(codes, bits), scales, offsets, group_size, bits)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A group-quantized projection `[out_features, in_features]` (QUANT-GROUP-1).

    A `LayerWeights` projection (or the output projection) may be one of these
    instead of a dense tensor; the decoder calls `linear(x)`, which is the
    definition, `quantized_linear`. Engines substitute objects with the same
    `shape`, `linear`, `dequantize` and `to` that run a fast kernel.
    """

    qweight: Tensor
    scales: Tensor
    offsets: Tensor
    group_size: int
    bits: int

    def __post_init__(self) -> None:
        check_quantized(self.qweight, self.scales, self.offsets, self.group_size, self.bits)

    @property
    def shape(self) -> tuple[int, int]:
        columns = self.qweight.shape[1]
        return (self.qweight.shape[0], columns * 2 if self.bits == 4 else columns)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.offsets))

    def dequantize(self) -> Tensor:
        return dequantize_weight(
            self.qweight, self.scales, self.offsets, group_size=self.group_size, bits=self.bits
        )

    def linear(self, x: Tensor) -> Tensor:
        return quantized_linear(
            x, self.qweight, self.scales, self.offsets, group_size=self.group_size, bits=self.bits
        )

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(
            self.qweight.to(device),
            self.scales.to(device),
            self.offsets.to(device),
            self.group_size,
            self.bits,
        )
