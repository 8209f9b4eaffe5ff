"""top-k that keeps exactly k tokens (a sort and a cut): breaks SAMPLE-TOPK-2."""

import torch


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    order = z.argsort(dim=-1, descending=True, stable=True)
    rank = order.argsort(dim=-1)
    k = top_k[:, None]
    return ((k == 0) | (rank < k)) & (z > -torch.inf)
