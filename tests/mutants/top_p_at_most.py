"""top-p that keeps a token whose mass above equals p (`<=` where `<` belongs):
breaks SAMPLE-TOPP-1 only at an exact threshold, so only the exact-thresholds
strategy (dyadic probabilities) catches it."""

import torch

from decodespec.spec.sampling import check_logits
from decodespec.spec.softmax import check_tensor, softmax


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # validated like the spec, so the mutant differs in its one behaviour only
    check_logits(logits)
    check_tensor("top_p", top_p)
    z = logits.float()
    probs = softmax(z)
    above = ((z[:, None, :] > z[:, :, None]) * probs[:, None, :]).sum(-1)
    p = top_p[:, None]
    return ((p >= 1) | (above <= p)) & (z > -torch.inf)
