"""repetition penalty that divides every seen logit: breaks LOGITS-REP-1."""

import torch


def apply_penalties(logits, prompt_mask, output_counts, repetition, frequency, presence):
    z = logits.float()
    seen = prompt_mask | (output_counts > 0)
    z = torch.where(seen, z / repetition[:, None], z)
    counts = output_counts.float()
    return z - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
