"""min-p against each vocabulary chunk's own maximum instead of the row's: breaks
SAMPLE-MINP-1 only in rows longer than a chunk, so only the ties-across-chunks
strategy (the row's maximum tied in far-apart chunks, others well below) catches it."""

import math

import torch

from decodespec.spec.sampling import check_logits
from decodespec.spec.softmax import check_tensor

CHUNK = 1024


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # validated like the spec, so the mutant differs in its one behaviour only
    check_logits(logits)
    check_tensor("min_p", min_p)
    z = logits.float()
    log_m = min_p.to(device=z.device, dtype=torch.float32).log()[:, None]
    chunks = [z[:, start : start + CHUNK] for start in range(0, z.shape[-1], CHUNK)]
    kept = [c >= c.amax(dim=-1, keepdim=True) + log_m for c in chunks]
    return torch.cat(kept, dim=-1) & (z > -math.inf)
