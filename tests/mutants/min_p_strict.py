"""min-p that keeps the row's maximum, then drops a token exactly at
`z_max + ln m` (`>` where `>=` belongs): breaks SAMPLE-MINP-1 only at an exact
threshold below the maximum, so only the exact-thresholds strategy catches it."""

import torch

from decodespec.spec.sampling import check_logits
from decodespec.spec.softmax import check_tensor


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # validated like the spec, so the mutant differs in its one behaviour only
    check_logits(logits)
    check_tensor("min_p", min_p)
    z = logits.float()
    z_max = z.amax(dim=-1, keepdim=True)
    threshold = z_max + min_p.to(z.device).float().log()[:, None]
    return ((z > threshold) | (z == z_max)) & (z > -torch.inf)
