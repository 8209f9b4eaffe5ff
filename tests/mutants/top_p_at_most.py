"""top-p that keeps a token whose mass above equals p (`<=` where `<` belongs):
breaks SAMPLE-TOPP-1 only at an exact threshold, so only the exact-thresholds
strategy (dyadic probabilities) catches it."""

import torch

from decodespec.spec.softmax import softmax


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    probs = softmax(z)
    above = ((z[:, None, :] > z[:, :, None]) * probs[:, None, :]).sum(-1)
    p = top_p[:, None]
    return ((p >= 1) | (above <= p)) & (z > -torch.inf)
