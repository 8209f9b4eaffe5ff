"""Split-KV attention that merges its parts (512 keys each) by a plain average of
their outputs instead of weighting each by exp(lse_part − lse): breaks
ATTN-SCALE-1 only in rows over more than 512 keys, so only the many-kv-tiles
cases catch it."""

import torch

from decodespec.spec.attention import paged_attention as spec_paged_attention

SPLIT = 512


def paged_attention(
    q, k_cache, v_cache, block_table, seq_lens, query_start, *, scale=None, return_lse=False,
    validate=True,
):  # fmt: skip
    out, lse = spec_paged_attention(
        q, k_cache, v_cache, block_table, seq_lens, query_start, scale=scale, return_lse=True
    )
    lens, starts = seq_lens.tolist(), query_start.tolist()
    block_size = k_cache.shape[1]
    for b, seq_len in enumerate(lens):
        for t in range(starts[b], starts[b + 1]):
            visible = seq_len - (starts[b + 1] - t) + 1
            if visible <= SPLIT:
                continue
            parts = []
            for start in range(0, visible, SPLIT):  # each part: the keys start .. start+SPLIT
                table = block_table[b : b + 1, start // block_size :]
                part_len = torch.tensor([min(SPLIT, visible - start)])
                rows = torch.tensor([0, 1])
                parts.append(
                    spec_paged_attention(
                        q[t : t + 1], k_cache, v_cache, table, part_len, rows, scale=scale
                    )
                )
            out[t] = torch.stack(parts).mean(0)[0].to(out.dtype)  # the bug: unweighted
    return (out, lse) if return_lse else out
