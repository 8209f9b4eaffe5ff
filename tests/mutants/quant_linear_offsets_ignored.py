"""quantized_linear that drops the offsets, `W = s · q` (a symmetric-only kernel given an
asymmetric format): breaks QUANT-GROUP-1. Everything else is the spec's; the offsets are
still checked, so only the values are wrong."""

import torch

from decodespec.spec import quant


def quantized_linear(x, qweight, scales, offsets, *, group_size, bits):
    if isinstance(offsets, torch.Tensor) and offsets.dtype.is_floating_point:
        offsets = torch.zeros_like(offsets)  # the mutation: no offsets
    return quant.quantized_linear(x, qweight, scales, offsets, group_size=group_size, bits=bits)
