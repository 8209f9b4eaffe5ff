"""vLLM's sampler as `top_k_mask` and `top_p_mask` (CUDA only).

Both map onto `vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p(logits,
k, p)`, the op vLLM's V1 sampler filters logits with: it returns the logits
with every token it drops set to −inf (it may write into its input, so it is
given a copy), and a token is kept where the result is above −inf.
`top_k_mask` passes only `k`, `top_p_mask` only `p`. The spec's
`top_k = 0` ("keep every token") is passed as the vocabulary size, the value
vLLM's own batch state uses for a request without top-k; `top_p = 1` is
passed as is (vLLM's "no top-p" too).

vLLM is installed only on CUDA machines here: without a GPU, or without the
package, every operation raises RuntimeError saying what is missing. The
package is imported inside the functions, so this module imports anywhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

PEER = {
    "name": "vLLM",
    "package": "vllm",
    "functions": "vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p",
}
PEER_REQUIRES = "cuda"


def _apply_top_k_top_p():
    """vLLM's apply_top_k_top_p, or RuntimeError naming what is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError("vLLM needs a CUDA GPU: torch.cuda.is_available() is False")
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except ImportError as error:
        raise RuntimeError(f"vLLM is not installed (pip install vllm): {error}") from error
    return apply_top_k_top_p


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """`decodespec.spec.sampling.top_k_mask` by vLLM's `apply_top_k_top_p(logits, k, None)`."""
    apply_top_k_top_p = _apply_top_k_top_p()
    vocab = logits.shape[-1]
    k = torch.where(top_k == 0, vocab, top_k).to(device=logits.device, dtype=torch.int64)
    return apply_top_k_top_p(logits.clone(), k, None) > -math.inf


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """`decodespec.spec.sampling.top_p_mask` by vLLM's `apply_top_k_top_p(logits, None, p)`."""
    apply_top_k_top_p = _apply_top_k_top_p()
    p = top_p.to(device=logits.device, dtype=torch.float32)
    return apply_top_k_top_p(logits.clone(), None, p) > -math.inf
