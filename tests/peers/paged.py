"""Glue shared by the attention peers: pages in, per-sequence dense K/V out, packed rows back.

Most peers (PyTorch SDPA, flex attention, transformers' attention functions)
take dense keys and values, one sequence (or a padded batch) at a time; none
takes the spec's paged cache and packed queries. `paged_attention` here does
only the layout work around a peer's function (`adapter` gives it the
spec's signature):

* gathers sequence b's keys and values from the pages of its block table
  row (ATTN-LAYOUT-1: position j in block `block_table[b, j // block_size]`
  at offset `j % block_size`) into dense `[seq_len, num_kv_heads, head_dim]`
  tensors, reading only the first `ceil(seq_len / block_size)` entries;
* hands each sequence that has query rows to the peer's `attend` with its
  rows of `q`, in that sequence's order;
* concatenates what the peer returns, in `q`'s row order.

It never computes a score, a mask value or a softmax: the peer decides the
causal alignment (each adapter builds the peer's own bottom-right mask), the
GQA mapping, the scale, the precision and what a sequence without keys gives.
It does not validate arguments either (`validate` is accepted for the
signature's sake): bad ones reach the gather or the peer as they are. The
gather uses `index_select`, which raises IndexError on an out-of-range block
id (negative ones included) instead of wrapping around.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# attend(q_rows [q_len, num_q_heads, head_dim],
#        keys, values [seq_len, num_kv_heads, head_dim], scale, return_lse)
#     -> out [q_len, num_q_heads, head_dim], or (out, lse [q_len, num_q_heads])
Attend = Callable[[Tensor, Tensor, Tensor, "float | None", bool], "Tensor | tuple[Tensor, Tensor]"]


def gather_sequence(cache: Tensor, block_table_row: Tensor, seq_len: int) -> Tensor:
    """Positions 0..seq_len−1 of one sequence, `[seq_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    blocks = block_table_row[: -(-seq_len // block_size)]  # int32 or int64, as given
    pages = cache.index_select(0, blocks)  # [used_blocks, block_size, num_kv_heads, head_dim]
    return pages.flatten(0, 1)[:seq_len]


def adapter(attend: Attend, peer: str, lse_refusal: str | None = None) -> Callable:
    """The operation `paged_attention`, with the spec's signature, around a peer's `attend`.

    `lse_refusal`: the peer returns no log-sum-exp, and `return_lse=True`
    raises NotImplementedError with this message. `validate` is accepted and
    ignored: the peers have no such checks, and the glue adds none.
    """

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
        if return_lse and lse_refusal:
            raise NotImplementedError(lse_refusal)
        tensors = (q, k_cache, v_cache, block_table, seq_lens, query_start)
        return attend_each_sequence(attend, *tensors, scale=scale, return_lse=return_lse)

    paged_attention.__doc__ = f"`decodespec.spec.attention.paged_attention` computed by {peer}."
    return paged_attention


def attend_each_sequence(
    attend: Attend,
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    *,
    scale: float | None,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """Run `attend` once per sequence with query rows; pack its outputs in `q`'s order.

    A batch without any query rows never calls the peer: its output is an
    empty `[0, num_q_heads, head_dim]` tensor of q's dtype, and its lse an
    empty one of the dtype every peer here returns it in (float32, float64
    for float64 queries).
    """
    lens, starts = seq_lens.tolist(), query_start.tolist()
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        if end == start:  # no rows of this sequence in the step: nothing to ask the peer
            continue
        keys = gather_sequence(k_cache, block_table[b], seq_len)
        values = gather_sequence(v_cache, block_table[b], seq_len)
        result = attend(q[start:end], keys, values, scale, return_lse)
        if return_lse:
            out, lse = result
            lses.append(lse)
        else:
            out = result
        outs.append(out)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    if not outs:
        out = q.new_empty(0, num_q_heads, head_dim)
        lse_dtype = torch.promote_types(q.dtype, torch.float32)
        lse = torch.empty(0, num_q_heads, dtype=lse_dtype, device=q.device)
    else:
        out = torch.cat(outs)
        lse = torch.cat(lses) if return_lse else None
    return (out, lse) if return_lse else out
