"""top-n logprobs merged from per-chunk candidates with the later chunk first on
ties: breaks LOGPROB-TOP-1 only when tied values sit in different vocabulary
chunks, so only the ties-across-chunks strategy catches it."""

import torch

from decodespec.spec.sampling import Logprobs
from decodespec.spec.sampling import compute_logprobs as spec_compute_logprobs

CHUNK = 1024


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int = 0) -> Logprobs:
    right = spec_compute_logprobs(logits, token_ids, num_top)
    lp = torch.log_softmax(logits.float(), dim=-1)
    vocab = lp.shape[-1]
    # Candidates chunk by chunk, the later chunks first; a stable sort by value keeps
    # that order among equal values, so a tie goes to the later chunk.
    ids = torch.cat([torch.arange(s, min(s + CHUNK, vocab)) for s in range(0, vocab, CHUNK)][::-1])
    ids = ids.to(lp.device).expand(lp.shape[0], vocab)
    order = lp.gather(-1, ids).argsort(dim=-1, descending=True, stable=True)[:, :num_top]
    top_ids = ids.gather(-1, order)
    return right._replace(top_token_ids=top_ids, top_logprobs=right.top_logprobs)
