"""top-k that keeps the tokens tied at the boundary only in the first vocabulary
chunk holding one (a streaming kernel that stops once it has k): breaks
SAMPLE-TOPK-2 only across chunks, so only the ties-across-chunks strategy catches it."""

import torch

from decodespec.spec.sampling import top_k_mask as spec_top_k_mask

CHUNK = 1024


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    mask = spec_top_k_mask(logits, top_k)
    z = logits.float().masked_fill(~mask, torch.inf)
    boundary = z.amin(dim=-1, keepdim=True)  # the k-th largest value, where top-k is on
    at_boundary = mask & (z == boundary) & (top_k[:, None] > 0)
    chunk = torch.arange(z.shape[-1], device=z.device) // CHUNK
    first = torch.where(at_boundary, chunk, chunk.max() + 1).amin(dim=-1, keepdim=True)
    return mask & ~(at_boundary & (chunk != first))
