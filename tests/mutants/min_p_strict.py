"""min-p that keeps the row's maximum, then drops a token exactly at
`z_max + ln m` (`>` where `>=` belongs): breaks SAMPLE-MINP-1 only at an exact
threshold below the maximum, so only the exact-thresholds strategy catches it."""

import torch


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    z = logits.float()
    z_max = z.amax(dim=-1, keepdim=True)
    threshold = z_max + min_p.to(z.device).float().log()[:, None]
    return ((z > threshold) | (z == z_max)) & (z > -torch.inf)
