"""quantized_linear reading element 2j from the high nibble of byte j and 2j + 1 from the
low one: breaks QUANT-CODES-1. Scales, offsets, groups and the float32 product are the
spec's, so only the nibble order is wrong (8-bit codes are right)."""

import torch

from decodespec.spec import quant


def quantized_linear(x, qweight, scales, offsets, *, group_size, bits):
    if bits == 4 and isinstance(qweight, torch.Tensor) and qweight.dtype == torch.uint8:
        qweight = (qweight >> 4) | (qweight << 4)  # the mutation: nibbles swapped
    return quant.quantized_linear(x, qweight, scales, offsets, group_size=group_size, bits=bits)
