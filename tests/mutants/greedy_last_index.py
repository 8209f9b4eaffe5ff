"""greedy with ties to the largest index: breaks SAMPLE-GREEDY-1."""

import torch


def greedy(logits: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    return vocab - 1 - logits.flip(-1).float().argmax(dim=-1)
