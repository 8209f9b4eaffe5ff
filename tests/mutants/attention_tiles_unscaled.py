"""Paged attention by online softmax over tiles of 64 keys that forgets to rescale
the running output when a later tile raises the maximum (the denominator is
rescaled): breaks ATTN-SCALE-1 only in sequences longer than a tile, so only the
many-kv-tiles cases catch it."""

import math

import torch

from decodespec.spec.attention import check_attention_args, sequence_slots
from decodespec.spec.softmax import compute_dtype

TILE = 64


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start, *, scale=None, return_lse=False,
    validate=True,
):  # fmt: skip
    lens, starts = check_attention_args(
        q, k_cache, v_cache, block_table, seq_lens, query_start, scale
    )
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    acc_dtype = compute_dtype(q.dtype)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=acc_dtype, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=acc_dtype, device=q.device)
    for b, seq_len in enumerate(lens):
        for t in range(starts[b], starts[b + 1]) if seq_len else ():
            visible = seq_len - (starts[b + 1] - t) + 1  # keys 0 .. position
            slots = sequence_slots(block_table[b], visible, block_size)
            heads = torch.arange(num_q_heads, device=q.device) // group
            keys = flat_k[slots][:, heads].to(acc_dtype)  # [visible, heads, dim]
            values = flat_v[slots][:, heads].to(acc_dtype)
            scores = scale * (keys * q[t].to(acc_dtype)).sum(-1)  # [visible, heads]
            running_max = torch.full((num_q_heads,), -math.inf, dtype=acc_dtype)
            total = torch.zeros(num_q_heads, dtype=acc_dtype)
            acc = torch.zeros(num_q_heads, head_dim, dtype=acc_dtype)
            for start in range(0, visible, TILE):
                s = scores[start : start + TILE]
                new_max = torch.maximum(running_max, s.amax(0))
                weights = (s - new_max).exp()
                total = total * (running_max - new_max).exp() + weights.sum(0)
                # the bug: acc is not multiplied by exp(running_max − new_max)
                acc = acc + (weights[:, :, None] * values[start : start + TILE]).sum(0)
                running_max = new_max
            out[t] = acc / total[:, None]
            lse[t] = running_max + total.log()
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
