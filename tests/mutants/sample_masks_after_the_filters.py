"""`sample` that applies a grammar's token bitmask after the filters instead of before
them, as a chain-first engine would without its second pass: breaks MASK-ORDER-1 and
MASK-SAMPLE-1 (top-k 1 keeps a disallowed maximum, and the row ends with nothing)."""

import torch

from decodespec.spec import sampling
from decodespec.spec.token_mask import apply_token_bitmask


def sample(logits, *, token_bitmask=None, **args):
    if token_bitmask is None:
        return sampling.sample(logits, **args)
    filtered = sampling.process_logits(logits, **{k: v for k, v in args.items() if k != "seed"})
    masked = apply_token_bitmask(filtered, token_bitmask)  # the mutation: after the filters
    sampled = args["temperature"] > 0
    return sampling.sample(
        masked,
        temperature=torch.where(sampled, 1.0, 0.0),
        seed=args.get("seed"),
        step=args.get("step"),
    )
