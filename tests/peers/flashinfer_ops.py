"""FlashInfer as `paged_attention`, `top_k_mask` and `top_p_mask` (CUDA only).

Attention: `flashinfer.BatchPrefillWithPagedKVCacheWrapper`, FlashInfer's
paged prefill/append kernel, which serves decode rows, chunks and whole
prompts of one batch alike. The spec's cache already has FlashInfer's "NHD"
page layout, `[num_pages, page_size, num_kv_heads, head_dim]`, so the caches
are passed as they are (`(k_cache, v_cache)`); the glue only rewrites the
block table in FlashInfer's CSR form:

* `kv_indptr[b + 1] = kv_indptr[b] + ceil(seq_lens[b] / page_size)`,
* `kv_indices`: the first `ceil(seq_lens[b] / page_size)` entries of each
  block table row, concatenated (the only entries read, ATTN-BOUNDS-1),
* `kv_last_page_len[b] = seq_lens[b] − (pages_b − 1) · page_size` (0 for a
  sequence without pages),
* `qo_indptr = query_start`.

`causal=True` is FlashInfer's bottom-right causal mask (query row r of a
sequence sees keys up to `kv_len − qo_len + r`); GQA is FlashInfer's own
(`num_qo_heads`, `num_kv_heads`); `sm_scale` is the scale as given (None:
FlashInfer's default `1 / sqrt(head_dim)`).

The log-sum-exp is FlashInfer's `run(..., return_lse=True)`. FlashInfer
keeps attention states in base 2: its documentation of the paged prefill
primitive says "the log-sum-exp of attention logits (base 2)", and vLLM
merges FlashInfer's states with `is_lse_base_on_e=False`. The adapter
multiplies it by ln 2 to give the spec's natural logarithm (ATTN-LSE-1);
that conversion is the only arithmetic here.

Sampling masks: `top_k_mask` keeps the tokens that
`flashinfer.sampling.top_k_mask_logits` leaves above −inf; `top_p_mask`
keeps those to which `flashinfer.sampling.top_p_renorm_probs` gives a
positive probability, on the probabilities `softmax(logits)` in float32
(the function takes probabilities). The spec's `top_k = 0` ("keep every
token") is passed as the vocabulary size, FlashInfer's (and vLLM's) way of
asking for no top-k.

FlashInfer runs only on CUDA GPUs: without one, or without the package,
every operation raises RuntimeError saying what is missing. The package is
imported inside the functions, so this module imports anywhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

PEER = {
    "name": "FlashInfer",
    "package": "flashinfer-python",
    "functions": "flashinfer.BatchPrefillWithPagedKVCacheWrapper (plan/run, causal=True, "
    "return_lse), flashinfer.sampling.top_k_mask_logits, flashinfer.sampling.top_p_renorm_probs",
}
PEER_REQUIRES = "cuda"

# FlashInfer's recommended workspace (its examples allocate 128 MB).
_WORKSPACE_BYTES = 128 * 1024 * 1024
_workspace: dict[torch.device, Tensor] = {}


def _flashinfer():
    """The flashinfer package, or RuntimeError naming what is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError("FlashInfer needs a CUDA GPU: torch.cuda.is_available() is False")
    try:
        import flashinfer
    except ImportError as error:
        raise RuntimeError(
            f"FlashInfer is not installed (pip install flashinfer-python): {error}"
        ) from error
    return flashinfer


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool = True,
) -> Tensor | tuple[Tensor, Tensor]:
    """`decodespec.spec.attention.paged_attention` computed by FlashInfer's paged prefill.

    `validate` is accepted and ignored: FlashInfer's own checks are what run.
    """
    flashinfer = _flashinfer()
    device = q.device
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]

    lens = seq_lens.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    used = torch.arange(block_table.shape[1], device=device)[None, :] < pages[:, None]
    kv_indices = block_table[used].to(torch.int32)  # row by row: each row's first pages
    kv_last_page_len = torch.where(pages > 0, lens - (pages - 1) * page_size, 0).to(torch.int32)

    if device not in _workspace:
        _workspace[device] = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace[device], "NHD")
    wrapper.plan(
        query_start.to(torch.int32),
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        num_q_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal=True,
        sm_scale=scale,
        q_data_type=q.dtype,
        kv_data_type=k_cache.dtype,
    )
    if not return_lse:
        return wrapper.run(q, (k_cache, v_cache))
    out, lse_base2 = wrapper.run(q, (k_cache, v_cache), return_lse=True)
    return out, lse_base2 * math.log(2.0)


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """`decodespec.spec.sampling.top_k_mask` by `flashinfer.sampling.top_k_mask_logits`."""
    flashinfer = _flashinfer()
    vocab = logits.shape[-1]
    k = torch.where(top_k == 0, vocab, top_k).to(device=logits.device, dtype=torch.int32)
    masked = flashinfer.sampling.top_k_mask_logits(logits, k)
    return masked > -math.inf


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """`decodespec.spec.sampling.top_p_mask` by `flashinfer.sampling.top_p_renorm_probs`."""
    flashinfer = _flashinfer()
    probs = torch.softmax(logits.float(), dim=-1)
    p = top_p.to(device=logits.device, dtype=torch.float32)
    return flashinfer.sampling.top_p_renorm_probs(probs, p) > 0
