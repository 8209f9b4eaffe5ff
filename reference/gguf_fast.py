"""Whole GGUF tensors decoded fast: `spec.gguf_blocks`' functions, bit for bit, in numpy.

`spec.gguf_blocks` defines what the bytes of GGUF's block types mean
(GGUF-BLOCK-1 ...) in plain torch, one element-wise operation per field; on
the bundled model's 210 Q4_1 projections that takes seconds (a dozen passes
over views whose rows are 16 bytes long). The loader runs these instead:

- `dequantize_fast`: the float32 weights of F32, F16, BF16, Q8_0, Q4_0,
  Q4_1 and Q4_K tensors with the `gguf` package's formulas (what the loader
  computed before): every product of them is exact in float32, so each
  weight is its formula's value rounded once, in any grouping
  (GGUF-BLOCK-1), and float16 fields convert as numpy converts them. Other
  types raise `KeyError`; the caller falls back.
- `groups_fast`: Q4_0, Q4_1 and Q4_K as a `QuantizedWeight`, equal to
  `gguf_groups` bit for bit (codes, scales and offsets; float16 fields
  converted as torch converts them, as the spec does); other types go to
  `gguf_groups`.

Both run in numpy, one thread, with no torch operation per tensor: on a
2-core machine other processes also use, every torch parallel region waited
for a descheduled worker thread (milliseconds each, measured: 400 small
operations 0.04 s on one thread, 1.7 s on two), which made the load's wall
time a multiple of its CPU time.

Both unpack the 4-bit codes 64 bits at a time (`_element_codes`,
`_quant_codes`): a GGUF code byte holds elements `j` and `j + 16` of a
32-element chunk (low and high nibble), QUANT-CODES-1 packs consecutive
elements `2k, 2k + 1` into one byte. tests/engine/test_load_speed_format.py
compares both with the spec on random blocks of every type.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch import Tensor

from decodespec.spec.gguf_blocks import check_gguf, gguf_groups
from decodespec.spec.quant import QuantizedWeight

# 4-bit types: (bytes per block, byte offset of the codes, bytes per 64-element chunk of
# codes). A chunk of S code bytes holds 2·S elements: S of them in the low nibbles,
# the next S in the high nibbles (Q4_0/Q4_1: one 32-element block; Q4_K: sub-blocks
# 2c and 2c + 1 of a 256-element block).
FOUR_BIT_LAYOUT = {"Q4_0": (18, 2, 16), "Q4_1": (20, 4, 16), "Q4_K": (144, 16, 32)}
FAST_DEQUANTIZE = ("F32", "F16", "BF16", "Q8_0", *FOUR_BIT_LAYOUT)

LITTLE_ENDIAN = sys.byteorder == "little"  # the words' byte order below assumes it
_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_LANE_LOW = 0x000F000F000F000F  # the low nibble of each 16-bit lane
_LANE_HIGH = 0x00F000F000F000F0


def _blocks(data: Tensor, type_name: str, columns: int) -> np.ndarray:
    """`data` checked (GGUF-VALID-1) as numpy uint8 `[blocks, block_bytes]` (no copy)."""
    blocks = check_gguf(data, type_name, columns)
    return blocks.contiguous().numpy().reshape(-1, blocks.shape[-1])


def _code_words(blocks: np.ndarray, type_name: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """The code bytes of 4-bit blocks as uint64 words, and their shape
    `(blocks, chunks, words per chunk)`."""
    size, offset, chunk = FOUR_BIT_LAYOUT[type_name]
    codes = np.ascontiguousarray(blocks[:, offset:])
    return codes.view(np.uint64).reshape(-1), (len(blocks), (size - offset) // chunk, chunk // 8)


def _element_codes(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """The codes of 4-bit blocks in element order, uint8 `[blocks, elements]`."""
    words, (count, chunks, width) = _code_words(blocks, type_name)
    out = np.empty((count, chunks, 2, width), np.uint64)
    out[:, :, 0] = (words & _LOW_NIBBLES).reshape(count, chunks, width)
    out[:, :, 1] = ((words >> 4) & _LOW_NIBBLES).reshape(count, chunks, width)
    return out.view(np.uint8).reshape(count, -1)


def _squeeze_lanes(lanes: np.ndarray) -> np.ndarray:
    """Each uint64's four 16-bit lanes (values < 256) as the four low bytes, in place."""
    lanes |= lanes >> 8
    lanes &= 0x0000FFFF0000FFFF
    lanes |= lanes >> 16
    return lanes


def _quant_codes(blocks: np.ndarray, type_name: str) -> np.ndarray:
    """The codes of 4-bit blocks packed in QUANT-CODES-1's order (element `2k` in the low
    nibble of byte `k`, `2k + 1` in its high nibble), uint8 `[blocks, elements / 2]`.

    In a 16-bit lane `h` of code bytes `b_2k, b_2k+1`, elements `2k, 2k + 1` of the
    low half are the bytes' low nibbles (`h & 0xF`, `(h >> 4) & 0xF0`), those of the
    high half their high nibbles (`(h >> 4) & 0xF`, `(h >> 8) & 0xF0`).
    """
    words, (count, chunks, width) = _code_words(blocks, type_name)
    low = (words & _LANE_LOW) | ((words >> 4) & _LANE_HIGH)
    high = ((words >> 4) & _LANE_LOW) | ((words >> 8) & _LANE_HIGH)
    out = np.empty((count, chunks, 2, width), np.uint32)  # the low 4 bytes of each word
    out[:, :, 0] = _squeeze_lanes(low).reshape(count, chunks, width)
    out[:, :, 1] = _squeeze_lanes(high).reshape(count, chunks, width)
    return out.view(np.uint8).reshape(count, -1)


def _half(blocks: np.ndarray, byte: int) -> np.ndarray:
    """The float16 field at `byte` of each block, as float32 (numpy's exact conversion)."""
    return blocks[:, byte : byte + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _half_as_torch(blocks: np.ndarray, byte: int) -> np.ndarray:
    """The float16 field at `byte` of each block as torch converts it to float32 (the
    spec's `_f16`): numpy's exact conversion, signalling NaNs made quiet as torch makes
    them. In numpy, not torch: one torch operation per field would be one more parallel
    region per tensor, and on a busy 2-core machine each region waited milliseconds."""
    values = _half(blocks, byte)
    bits = values.view(np.uint32)
    bits[np.isnan(values)] |= 0x00400000  # the quiet bit
    return values


def _q4_k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales `sc_j` and minimums `m_j` of Q4_K blocks (GGUF-Q4K-1),
    uint8 `[blocks, 8]`."""
    low, high, mixed = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=1)
    return sc, m


def dequantize_fast(data: Tensor, type_name: str, columns: int) -> Tensor:
    """`dequantize_gguf(data, type_name, columns)` for the types of `FAST_DEQUANTIZE`,
    computed as the `gguf` package computes it; float32 `[rows, columns]`, its own memory.

    Raises:
        KeyError: another type.
        ValueError: GGUF-VALID-1's errors.
    """
    if type_name not in FAST_DEQUANTIZE or not LITTLE_ENDIAN:
        raise KeyError(type_name)
    rows = data.shape[0]
    blocks = _blocks(data, type_name, columns)
    if type_name == "F32":
        values = blocks.view(np.float32).copy()
    elif type_name == "F16":
        values = blocks.view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        values = (blocks.view(np.int16).astype(np.int32) << 16).view(np.float32)
    elif type_name == "Q8_0":
        values = np.multiply(blocks[:, 2:].view(np.int8), _half(blocks, 0)[:, None])
    elif type_name == "Q4_0":  # d · (q − 8)
        values = _element_codes(blocks, type_name).astype(np.float32)
        values -= 8
        values *= _half(blocks, 0)[:, None]
    elif type_name == "Q4_1":  # d · q + m
        values = np.multiply(_element_codes(blocks, type_name), _half(blocks, 0)[:, None])
        values += _half(blocks, 2)[:, None]
    else:  # Q4_K: (d · sc_j) · q − dmin · m_j
        sc, m = _q4_k_scales(blocks)
        scales = _half(blocks, 0)[:, None] * sc.astype(np.float32)
        minimums = _half(blocks, 2)[:, None] * m.astype(np.float32)
        codes = _element_codes(blocks, type_name).reshape(len(blocks), 8, 32)
        values = np.multiply(codes, scales[..., None])
        values -= minimums[..., None]
    return torch.from_numpy(values.reshape(rows, columns))


def groups_fast(data: Tensor, type_name: str, columns: int) -> QuantizedWeight:
    """`gguf_groups(data, type_name, columns)`, bit for bit: Q4_0, Q4_1 and Q4_K here,
    any other type by `gguf_groups` itself (and its errors)."""
    if type_name not in FOUR_BIT_LAYOUT or not LITTLE_ENDIAN:
        return gguf_groups(data, type_name, columns)
    rows = data.shape[0]
    blocks = _blocks(data, type_name, columns)
    qweight = _quant_codes(blocks, type_name).reshape(rows, columns // 2)
    d = _half_as_torch(blocks, 0)
    if type_name == "Q4_0":
        scales, offsets = d, d * np.float32(-8.0)
    elif type_name == "Q4_1":
        scales, offsets = d, _half_as_torch(blocks, 2)
    else:  # the products are exact in float32: computed here as torch computes them
        sc, m = (x.astype(np.float32) for x in _q4_k_scales(blocks))
        scales, offsets = d[:, None] * sc, -(_half_as_torch(blocks, 2)[:, None] * m)
    groups = columns // 32
    return QuantizedWeight(
        torch.from_numpy(qweight),
        torch.from_numpy(scales.reshape(rows, groups)),
        torch.from_numpy(offsets.reshape(rows, groups)),
        32,
        4,
    )
