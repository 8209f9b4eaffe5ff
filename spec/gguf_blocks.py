"""Weight formats: GGUF's quantized blocks, byte by byte.

A GGUF file (llama.cpp's format) stores each weight matrix as rows of
fixed-size blocks. This module defines what the bytes of the block types an
engine meets in practice mean, as llama.cpp's `ggml-quants.c` and gguf-py's
`gguf/quants.py` decode them, and which of them are instances of the
group-quantized format QUANT-GROUP-1 (`quant`), so that one quantized linear
runs them all.

[GGUF-BLOCK-1] A tensor of type `T` with `rows` rows of `columns` elements
is a uint8 tensor `data` `[rows, row_bytes]`, its raw bytes as
`gguf.GGUFReader` gives them: row `r` of the weight is row `r` of `data`,
`columns / QK` consecutive blocks of `B` bytes each (`row_bytes = B ·
columns / QK`), block `b` holding elements `b · QK … b · QK + QK − 1` of the
row. `(QK, B)` per type: F32 (1, 4), F16 (1, 2), BF16 (1, 2), Q8_0 (32, 34),
Q4_0 (32, 18), Q4_1 (32, 20), Q4_K (256, 144), Q6_K (256, 210). Multi-byte
fields are little-endian. As in llama.cpp, every float16 field (a scale `d`,
a minimum `m`, `dmin`) and every integer field is converted exactly to
float32 and the formulas below are evaluated in float32. Every product in
them is exact in float32 (at most 11 + 7 + 5 significant bits), so each
weight is its formula's real value rounded once to float32 (to nearest, ties
to even): the grouping of the products and a fused multiply-add do not
change a bit. `dequantize_gguf` returns float32 `[rows, columns]`.

[GGUF-FLOAT-1] F32: each element is 4 bytes, an IEEE float32. F16: 2
bytes, an IEEE float16 converted exactly to float32. BF16: 2 bytes, the
upper 16 bits of a float32 whose lower 16 bits are 0. NaN and infinities
stay what they are, except that a NaN's payload is not specified (gguf-py
keeps a signalling NaN signalling, PyTorch's conversion quiets it); no
float type is an instance of QUANT-GROUP-1.

[GGUF-Q80-1] Q8_0, 32 elements in 34 bytes: bytes 0–1 the float16 scale
`d`, bytes 2–33 the codes `q_0 … q_31`, each a signed byte (int8, two's
complement), element `i` in byte `2 + i`. `y_i = q_i · d`.

[GGUF-Q40-1] Q4_0, 32 elements in 18 bytes: bytes 0–1 the float16 scale
`d`, bytes 2–17 sixteen bytes of 4-bit unsigned codes: for `j = 0 … 15`,
byte `2 + j` holds element `j` in its low nibble (`byte & 0xF`) and element
`j + 16` in its high nibble (`byte >> 4`). `y_i = d · (q_i − 8)`, the
integer `q_i − 8` (−8 … 7) times `d`.

[GGUF-Q41-1] Q4_1, 32 elements in 20 bytes: bytes 0–1 the float16 scale
`d`, bytes 2–3 the float16 minimum `m`, bytes 4–19 the codes, nibbles
ordered as in Q4_0 (byte `4 + j`: element `j` low, element `j + 16` high).
`y_i = d · q_i + m`.

[GGUF-Q4K-1] Q4_K, 256 elements in 144 bytes: bytes 0–1 the float16 `d`,
bytes 2–3 the float16 `dmin`, bytes 4–15 twelve bytes `s_0 … s_11` of
packed 6-bit sub-block scales `sc_j` and minimums `m_j`, bytes 16–143 the
4-bit codes. Sub-block `j = 0 … 7` is elements `32j … 32j + 31`. For
`j < 4`: `sc_j = s_j & 63`, `m_j = s_{j+4} & 63`. For `j ≥ 4`:
`sc_j = (s_{j+4} & 15) | ((s_{j−4} >> 6) << 4)` and
`m_j = (s_{j+4} >> 4) | ((s_j >> 6) << 4)`. Sub-blocks `2c` and `2c + 1`
(`c = 0 … 3`) share the 32 code bytes `16 + 32c … 16 + 32c + 31`: element
`l` of sub-block `2c` is the low nibble of byte `16 + 32c + l`, element
`l` of sub-block `2c + 1` its high nibble. `y = (d · sc_j) · q − dmin · m_j`.

[GGUF-Q6K-1] Q6_K, 256 elements in 210 bytes: bytes 0–127 `ql` (the low 4
bits of the codes), bytes 128–191 `qh` (their high 2 bits), bytes 192–207
sixteen signed 8-bit scales `sc_0 … sc_15`, bytes 208–209 the float16 `d`.
The block is two halves `h = 0, 1` of 128 elements; element `e = 0 … 127`
of half `h` (element `i = 128h + e` of the block) has low bits
`ql[64h + e % 64]`'s low nibble for `e < 64` and its high nibble for
`e ≥ 64`, and high bits `(qh[32h + e % 32] >> (2 · (e // 32))) & 3`;
`q = low | high << 4` (0 … 63). The scale of element `i` is
`sc_{i // 16}` (16-element sub-blocks). `y_i = d · sc_{i//16} · (q − 32)`.
Q6_K is not an instance of QUANT-GROUP-1 (6-bit codes, signed 8-bit scales
over 16 elements).

[GGUF-GROUPS-1] Q8_0, Q4_0, Q4_1 and Q4_K are instances of QUANT-GROUP-1
with `group_size = 32` (a block, or a Q4_K sub-block); `gguf_groups` gives
them as a `QuantizedWeight`: Q8_0 → `bits = 8`, codes `q`, scale `d`,
offset 0; Q4_0 → `bits = 4`, codes `q`, scale `d`, offset `−8 · d`;
Q4_1 → `bits = 4`, scale `d`, offset `m`; Q4_K → `bits = 4`, sub-block
`j`'s scale `d · sc_j` and offset `−dmin · m_j` (both exact in float32).
Scales and offsets are float32; codes are packed in QUANT-CODES-1's order
(consecutive elements, the even one in the low nibble), not in the block's.
For finite `d`, `m`, `dmin`, `dequantize_weight(gguf_groups(…))` equals
`dequantize_gguf(…)` bit for bit for Q4_1 and Q4_K (`s · q` is exact, so
both round the same real sum once), and for Q8_0 and Q4_0 bit for bit
except the sign of a zero: where the block's `q · d` or `d · (q − 8)` is −0
(a negative or −0 `d` times a zero), `s · q + o` is +0, the sum of a value
and its negation (or of −0 and +0). They are equal as numbers
(`torch.equal`) in every case. F32, F16, BF16 and Q6_K raise `ValueError`
naming the type.

[GGUF-VALID-1] Arguments are checked before any arithmetic: a `data` that
is not a tensor raises `TypeError` (ArgumentTypeError) naming it; `data`
not a 2-D uint8 tensor, a `type_name` not among the types of GGUF-BLOCK-1,
`columns` not a positive int multiple of the type's `QK`, and a
`row_bytes` other than `B · columns / QK` raise `ValueError` naming the
argument and what it got.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .quant import QuantizedWeight, pack_codes
from .softmax import check_tensor

# GGUF-BLOCK-1: elements per block (QK) and bytes per block (B), by type name.
BLOCK_TYPES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}
GROUP_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")  # instances of QUANT-GROUP-1 (GGUF-GROUPS-1)


def check_gguf(data: Tensor, type_name: str, columns: int) -> Tensor:
    """The blocks `[rows, columns / QK, B]` of `data`, or the error of GGUF-VALID-1."""
    check_tensor("data", data)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(
            f"data must be a 2-D uint8 tensor [rows, row_bytes], "
            f"got {data.dtype} of shape {list(data.shape)}"
        )
    if not isinstance(type_name, str) or type_name not in BLOCK_TYPES:
        raise ValueError(f"type_name must be one of {sorted(BLOCK_TYPES)}, got {type_name!r}")
    block_size, block_bytes = BLOCK_TYPES[type_name]
    if (
        isinstance(columns, bool)
        or not isinstance(columns, int)
        or columns < 1
        or columns % block_size
    ):
        raise ValueError(
            f"columns must be a positive multiple of {type_name}'s block size {block_size}, "
            f"got {columns!r}"
        )
    row_bytes = columns // block_size * block_bytes
    if data.shape[1] != row_bytes:
        raise ValueError(
            f"data's rows of {columns} {type_name} elements must be {row_bytes} bytes, "
            f"got row_bytes {data.shape[1]}"
        )
    return data.reshape(data.shape[0], columns // block_size, block_bytes)


def _f16(field: Tensor) -> Tensor:
    """A 2-byte little-endian float16 field `[..., 2]` as float32 `[...]` (exact)."""
    return field.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _nibbles(codes: Tensor) -> Tensor:
    """Q4_0 / Q4_1 code bytes `[..., 16]` as codes `[..., 32]` in element order:
    byte j's low nibble is element j, its high nibble element j + 16."""
    return torch.cat([codes & 0x0F, codes >> 4], dim=-1)


def _q4_k_fields(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K blocks `[..., 144]` -> codes `[..., 8, 32]` (uint8), the sub-block scales
    `d · sc_j` and minimums `dmin · m_j` `[..., 8]` (float32), GGUF-Q4K-1."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    low, high, mixed = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=-1)
    qs = blocks[..., 16:144].reshape(*blocks.shape[:-1], 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=-2)  # sub-blocks 2c, 2c + 1
    codes = codes.reshape(*blocks.shape[:-1], 8, 32)
    return codes, d[..., None] * sc.to(torch.float32), dmin[..., None] * m.to(torch.float32)


def _q6_k(blocks: Tensor) -> Tensor:
    """Q6_K blocks `[..., 210]` -> the weights `[..., 256]` (GGUF-Q6K-1)."""
    ql = blocks[..., 0:128].reshape(*blocks.shape[:-1], 2, 64)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 32)
    sc = blocks[..., 192:208].view(torch.int8).to(torch.float32)
    d = _f16(blocks[..., 208:210])
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-1)  # [..., 2, 128]
    high = torch.cat([(qh >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    q = (low | (high << 4)).to(torch.int32) - 32
    q = q.reshape(*blocks.shape[:-1], 16, 16).to(torch.float32)
    return ((d[..., None] * sc)[..., None] * q).flatten(-2)


def dequantize_gguf(data: Tensor, type_name: str, columns: int) -> Tensor:
    """The float32 weights `[rows, columns]` of a GGUF tensor's raw bytes (GGUF-BLOCK-1).

    Args:
        data: uint8 `[rows, row_bytes]`, one row of blocks per weight row.
        type_name: the GGUF type's name: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K.
        columns: elements per row, a multiple of the type's block size.

    Returns:
        float32 `[rows, columns]`, on `data`'s device.

    Example:
        >>> block = torch.tensor([[0x00, 0x3C, *range(-16, 16)]]).to(torch.uint8)  # d = 1.0
        >>> dequantize_gguf(block, "Q8_0", 32)[0, 14:18]
        tensor([-2., -1.,  0.,  1.])
    """
    blocks = check_gguf(data, type_name, columns)
    rows = data.shape[0]
    if type_name == "F32":
        return data.contiguous().view(torch.float32)
    if type_name == "F16":
        return data.contiguous().view(torch.float16).to(torch.float32)
    if type_name == "BF16":
        return data.contiguous().view(torch.bfloat16).to(torch.float32)
    if type_name == "Q8_0":
        d = _f16(blocks[..., 0:2])
        q = blocks[..., 2:34].view(torch.int8).to(torch.float32)
        weight = q * d[..., None]
    elif type_name == "Q4_0":
        d = _f16(blocks[..., 0:2])
        q = _nibbles(blocks[..., 2:18]).to(torch.int32) - 8
        weight = d[..., None] * q.to(torch.float32)
    elif type_name == "Q4_1":
        d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        q = _nibbles(blocks[..., 4:20]).to(torch.float32)
        weight = d[..., None] * q + m[..., None]
    elif type_name == "Q4_K":
        codes, scales, minimums = _q4_k_fields(blocks)
        weight = scales[..., None] * codes.to(torch.float32) - minimums[..., None]
    else:
        weight = _q6_k(blocks)
    return weight.reshape(rows, columns)


def gguf_groups(data: Tensor, type_name: str, columns: int) -> QuantizedWeight:
    """A GGUF tensor of type Q8_0, Q4_0, Q4_1 or Q4_K as a group-quantized weight
    with `group_size` 32 (GGUF-GROUPS-1), its codes repacked in QUANT-CODES-1's order.

    Args:
        data, type_name, columns: as for `dequantize_gguf`.

    Returns:
        a `QuantizedWeight` `[rows, columns]` whose `dequantize()` is
        `dequantize_gguf(data, type_name, columns)` (equal as numbers).

    Raises:
        ValueError: F32, F16, BF16 and Q6_K, which are not group-quantized, and
            the errors of GGUF-VALID-1.

    Example:
        >>> block = torch.tensor([[0x00, 0x3C, *range(-16, 16)]]).to(torch.uint8)  # d = 1.0
        >>> w = gguf_groups(block, "Q8_0", 32)
        >>> w.bits, w.group_size, w.scales, w.dequantize()[0, 14:18]
        (8, 32, tensor([[1.]]), tensor([-2., -1.,  0.,  1.]))
    """
    blocks = check_gguf(data, type_name, columns)
    if type_name not in GROUP_TYPES:
        raise ValueError(
            f"type_name {type_name!r} is not group-quantized (QUANT-GROUP-1); "
            f"only {', '.join(GROUP_TYPES)} are"
        )
    rows = data.shape[0]
    if type_name == "Q8_0":
        scales = _f16(blocks[..., 0:2])
        qweight = blocks[..., 2:34].view(torch.int8).reshape(rows, columns)
        return QuantizedWeight(qweight, scales, torch.zeros_like(scales), 32, 8)
    if type_name == "Q4_0":
        scales = _f16(blocks[..., 0:2])
        codes, offsets = _nibbles(blocks[..., 2:18]), scales * -8.0
    elif type_name == "Q4_1":
        scales, offsets = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        codes = _nibbles(blocks[..., 4:20])
    else:
        codes, scales, minimums = _q4_k_fields(blocks)
        offsets = -minimums
    groups = columns // 32
    qweight = pack_codes(codes.reshape(rows, columns), bits=4)
    return QuantizedWeight(
        qweight, scales.reshape(rows, groups), offsets.reshape(rows, groups), 32, 4
    )
