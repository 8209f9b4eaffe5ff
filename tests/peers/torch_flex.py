"""PyTorch's `flex_attention` as `paged_attention`.

Each sequence's keys and values are gathered from the pages
(`tests.peers.paged`) and passed, as a batch of one in flex attention's
`[batch, heads, length, head_dim]` layout, to
`torch.nn.attention.flex_attention.flex_attention` with a block mask built by
flex attention's own `create_block_mask` from a bottom-right causal
`mask_mod` (key index <= query index + seq_len − q_len) and
`enable_gqa=True`. `scale` is passed as is (None: flex's default).

The log-sum-exp comes from `return_aux=AuxRequest(lse=True)` (the
non-deprecated form of `return_lse=True`). Its kernels keep it in base 2,
but the public function converts it to the natural logarithm before
returning it (`_finalize_outputs`, `stats_are_log2`), and documents it as
"log-sum-exp of attention scores": it is used as returned.

Without `torch.compile`, flex attention runs its unfused reference
implementation (on CPU here), traced through dynamo with the eager backend.
"""

from __future__ import annotations

import warnings

from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from tests.peers import paged

PEER = {
    "name": "PyTorch flex attention",
    "package": "torch",
    "functions": "torch.nn.attention.flex_attention.flex_attention with create_block_mask "
    "(bottom-right causal mask_mod), enable_gqa=True, return_aux=AuxRequest(lse=True)",
}

# flex_attention warns, once, that it runs unfused without torch.compile.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float | None, return_lse: bool):
    q_len, seq_len = q.shape[0], keys.shape[0]
    offset = seq_len - q_len  # row r sits at position offset + r

    def bottom_right_causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    block_mask = create_block_mask(bottom_right_causal, None, None, q_len, seq_len, device=q.device)
    out, aux = flex_attention(
        q.transpose(0, 1)[None],  # [1, num_q_heads, q_len, head_dim]
        keys.transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
        values.transpose(0, 1)[None],
        block_mask=block_mask,
        scale=scale,
        enable_gqa=True,
        return_aux=AuxRequest(lse=return_lse),
    )
    out = out[0].transpose(0, 1)  # [q_len, num_q_heads, head_dim]
    return (out, aux.lse[0].transpose(0, 1)) if return_lse else out


paged_attention = paged.adapter(_attend, "flex attention")
