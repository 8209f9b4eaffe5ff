"""transformers' eager attention (`eager_attention_forward`, as in Llama) as `paged_attention`.

Each sequence's keys and values are gathered from the pages
(`tests.peers.paged`) and passed, as a batch of one in transformers'
`[batch, heads, length, head_dim]` layout, to
`transformers.models.llama.modeling_llama.eager_attention_forward`, with the
additive 4-D mask transformers builds for it, `transformers.masking_utils.eager_mask`
(0 where a key is visible, the dtype's minimum elsewhere), for `q_len`
queries at cache positions `seq_len − q_len ...` over `seq_len` keys: the
bottom-right causal alignment of a model decoding with a cache. The
function's GQA is its own `repeat_kv` by `module.num_key_value_groups`.

`scale=None` becomes `head_dim ** -0.5`, the `scaling` every transformers
attention module computes and passes (the function has no default).
The function returns the attention weights, not their log-sum-exp:
`return_lse=True` raises NotImplementedError.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import Tensor
from transformers.masking_utils import eager_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from tests.peers import paged

PEER = {
    "name": "transformers eager attention",
    "package": "transformers",
    "functions": "transformers.models.llama.modeling_llama.eager_attention_forward with "
    "transformers.masking_utils.eager_mask",
}
CONFORMANCE_UNSUPPORTED = {
    "lse": "eager_attention_forward returns the attention weights, not their log-sum-exp"
}

NO_LSE = "transformers' eager_attention_forward does not return the log-sum-exp"


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float | None, return_lse: bool):
    q_len, num_q_heads, head_dim = q.shape
    seq_len, num_kv_heads = keys.shape[0], keys.shape[1]
    # What LlamaAttention hands the function: the head ratio, eval mode, its causal flag.
    module = SimpleNamespace(
        num_key_value_groups=num_q_heads // num_kv_heads, training=False, is_causal=True
    )
    mask = eager_mask(
        batch_size=1,
        q_length=q_len,
        kv_length=seq_len,
        q_offset=seq_len - q_len,
        dtype=q.dtype,
        device=q.device,
    )
    out, _weights = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],  # [1, num_q_heads, q_len, head_dim]
        keys.transpose(0, 1)[None],  # [1, num_kv_heads, seq_len, head_dim]
        values.transpose(0, 1)[None],
        mask,
        scaling=head_dim**-0.5 if scale is None else scale,
        dropout=0.0,
    )
    return out[0]  # already [q_len, num_q_heads, head_dim]


paged_attention = paged.adapter(_attend, "transformers' eager attention", lse_refusal=NO_LSE)
