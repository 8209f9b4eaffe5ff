"""PyTorch's `scaled_dot_product_attention` as `paged_attention`.

Each sequence's keys and values are gathered from the pages
(`tests.peers.paged`) and passed, as a batch of one in SDPA's
`[batch, heads, length, head_dim]` layout, to
`torch.nn.functional.scaled_dot_product_attention` with
`attn_mask=causal_lower_right(q_len, seq_len)` (PyTorch's own bottom-right
causal bias: row r sees keys 0..seq_len − q_len + r) and `enable_gqa=True`
(SDPA's own grouped-query mapping). `scale` is passed as is (None: SDPA's
default). SDPA returns no log-sum-exp, so `return_lse=True` raises
NotImplementedError.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.nn.functional import scaled_dot_product_attention

from tests.peers import paged

PEER = {
    "name": "PyTorch SDPA",
    "package": "torch",
    "functions": "torch.nn.functional.scaled_dot_product_attention with "
    "torch.nn.attention.bias.causal_lower_right and enable_gqa=True",
}
CONFORMANCE_UNSUPPORTED = {"lse": "scaled_dot_product_attention returns no log-sum-exp"}


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float | None, return_lse: bool):
    q_len, seq_len = q.shape[0], keys.shape[0]
    out = scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, num_q_heads, q_len, head_dim]
        keys.transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
        values.transpose(0, 1)[None],
        attn_mask=causal_lower_right(q_len, seq_len),
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [q_len, num_q_heads, head_dim]


paged_attention = paged.adapter(
    _attend, "PyTorch SDPA", lse_refusal="PyTorch SDPA does not return the log-sum-exp"
)


__all__ = ["PEER", "paged_attention"]
