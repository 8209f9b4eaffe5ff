"""transformers' SDPA attention (`sdpa_attention_forward`) as `paged_attention`.

Each sequence's keys and values are gathered from the pages
(`tests.peers.paged`) and passed, as a batch of one in transformers'
`[batch, heads, length, head_dim]` layout, to
`transformers.integrations.sdpa_attention.sdpa_attention_forward`, with the
boolean 4-D mask transformers builds for it, `transformers.masking_utils.sdpa_mask`
(True where a key is visible), for `q_len` queries at cache positions
`seq_len − q_len ...` over `seq_len` keys: the bottom-right causal alignment
of a model decoding with a cache. As in a model, the mask builder may return
None where SDPA's own `is_causal` (or no mask) is equivalent (a whole prompt,
a single decode row), and the function then picks `is_causal` itself. GQA is
the function's own choice between SDPA's `enable_gqa`, packing the heads of
a decode row and `repeat_kv`, by `module.num_key_value_groups`.

`scale` is passed as is (None: SDPA's default). The function returns no
log-sum-exp: `return_lse=True` raises NotImplementedError.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from tests.peers import paged

PEER = {
    "name": "transformers SDPA attention",
    "package": "transformers",
    "functions": "transformers.integrations.sdpa_attention.sdpa_attention_forward with "
    "transformers.masking_utils.sdpa_mask",
}
CONFORMANCE_UNSUPPORTED = {
    "lse": "sdpa_attention_forward returns no log-sum-exp (its second result is None)"
}

NO_LSE = "transformers' sdpa_attention_forward does not return the log-sum-exp"


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float | None, return_lse: bool):
    q_len, num_q_heads, _ = q.shape
    seq_len, num_kv_heads = keys.shape[0], keys.shape[1]
    # What LlamaAttention hands the function: the head ratio, eval mode, its causal flag.
    module = SimpleNamespace(
        num_key_value_groups=num_q_heads // num_kv_heads,
        training=False,
        is_causal=True,
        layer_idx=0,
    )
    mask = sdpa_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=seq_len,
        q_offset=seq_len - q_len,
        device=q.device,
    )
    out, _ = sdpa_attention_forward(
        module,
        q.transpose(0, 1)[None],  # [1, num_q_heads, q_len, head_dim]
        keys.transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
        values.transpose(0, 1)[None],
        mask,
        dropout=0.0,
        scaling=scale,
    )
    return out[0]  # already [q_len, num_q_heads, head_dim]


paged_attention = paged.adapter(_attend, "transformers' SDPA attention", lse_refusal=NO_LSE)
