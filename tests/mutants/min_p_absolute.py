"""min-p against the absolute probability instead of m · π_max: breaks SAMPLE-MINP-1."""

import torch


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    return (probs >= min_p[:, None]) & (logits > -torch.inf)
