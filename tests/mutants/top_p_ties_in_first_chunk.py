"""top-p that keeps the tokens tied with the crossing token only in the first
vocabulary chunk holding one: breaks SAMPLE-TOPP-2 only across chunks, so only
the ties-across-chunks strategy catches it."""

import torch

from decodespec.spec.sampling import top_p_mask as spec_top_p_mask

CHUNK = 1024


def top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    mask = spec_top_p_mask(logits, top_p)
    z = logits.float().masked_fill(~mask, torch.inf)
    crossing = z.amin(dim=-1, keepdim=True)  # the least likely kept value
    at_crossing = mask & (z == crossing) & (top_p[:, None] < 1)
    chunk = torch.arange(z.shape[-1], device=z.device) // CHUNK
    first = torch.where(at_crossing, chunk, chunk.max() + 1).amin(dim=-1, keepdim=True)
    return mask & ~(at_crossing & (chunk != first))
