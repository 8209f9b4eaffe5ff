"""apply_token_bitmask reading the bits of each word from the most significant end (token
t allowed by bit `31 − t % 32`): breaks MASK-LAYOUT-1. The words and the padding
columns are handled as the spec does, so only the bit order is wrong."""

import math

import torch


def apply_token_bitmask(logits, bitmask, indices=None):
    batch, vocab = logits.shape
    bit = 31 - torch.arange(32, dtype=torch.int32)  # the mutation: reversed within a word
    allowed = ((bitmask[:, :, None] >> bit) & 1 == 1).reshape(batch, -1)[:, :vocab]
    padding = torch.zeros(batch, vocab - allowed.shape[1], dtype=torch.bool)
    allowed = torch.cat([allowed, padding], dim=1)
    rows = torch.zeros(batch, dtype=torch.bool)
    rows[indices.long() if indices is not None else slice(None)] = True
    return logits.masked_fill(~(allowed | ~rows[:, None]), -math.inf)
