"""uniform numbers from torch's generator, seeded per row: breaks SAMPLE-RNG-2 and -3."""

import torch


def uniform(seed, step, vocab_size, stream=0, dtype=torch.float32):
    rows = []
    for row in range(seed.shape[0]):
        g = torch.Generator().manual_seed(int(seed[row]) + row + int(step[row]))
        rows.append(torch.rand(vocab_size, generator=g, dtype=dtype))
    return torch.stack(rows).clamp(min=2.0**-24)
