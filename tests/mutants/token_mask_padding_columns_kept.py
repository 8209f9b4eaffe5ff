"""apply_token_bitmask that leaves the columns past the bitmask's `32 · words` as they
were, as xgrammar's `apply_token_bitmask_inplace` does without `vocab_size`: breaks
MASK-WIDTH-1 (logits wider than the bitmask keep the padding ids of the embedding)."""

import math

import torch


def apply_token_bitmask(logits, bitmask, indices=None):
    batch, vocab = logits.shape
    bit = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bit) & 1 == 1).reshape(batch, -1)[:, :vocab]
    padding = torch.ones(batch, vocab - allowed.shape[1], dtype=torch.bool)  # the mutation
    allowed = torch.cat([allowed, padding], dim=1)
    rows = torch.zeros(batch, dtype=torch.bool)
    rows[indices.long() if indices is not None else slice(None)] = True
    return logits.masked_fill(~(allowed | ~rows[:, None]), -math.inf)
