"""top-p that drops the token crossing the threshold: breaks SAMPLE-TOPP-2."""

import torch


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits.float(), dim=-1)
    at_or_above = (probs[:, None, :] >= probs[:, :, None]) * probs[:, None, :]
    p = top_p[:, None]
    return ((p >= 1) | (at_or_above.sum(-1) <= p)) & (logits > -torch.inf)
