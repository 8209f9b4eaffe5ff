"""greedy over vocabulary chunks whose merge keeps the later chunk on a tie
(`>=` where `>` belongs): breaks SAMPLE-GREEDY-1 only when the tied maxima sit in
different chunks, so only the ties-across-chunks strategy catches it."""

import torch

from decodespec.spec.sampling import check_logits

CHUNK = 1024


def greedy(logits: torch.Tensor) -> torch.Tensor:
    # validated like the spec, so the mutant differs in its one behaviour only
    check_logits(logits)
    z = logits.float()
    best_value = torch.full((z.shape[0],), -torch.inf, device=z.device)
    best_index = torch.zeros(z.shape[0], dtype=torch.int64, device=z.device)
    for start in range(0, z.shape[-1], CHUNK):
        values, index = z[:, start : start + CHUNK].max(dim=-1)  # first index within a chunk
        later = values >= best_value
        best_value = torch.where(later, values, best_value)
        best_index = torch.where(later, index + start, best_index)
    return best_index
