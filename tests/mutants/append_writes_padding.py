"""KV append that forgets to skip padding: a token at slot −1 is written too, and
negative indexing puts it in the cache's last slot. Breaks APPEND-SKIP-1; the
conformance suite compares the whole cache bit for bit, so the stray write fails
an assertion (the clean-failures family) instead of passing unseen."""

import torch

from decodespec.spec.append import check_append_args


def append_kv(key, value, k_cache, v_cache, slot_mapping, *, validate=True) -> None:
    if validate:
        check_append_args(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for cache, rows in ((k_cache, key), (v_cache, value)):
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat[slot_mapping.to(torch.int64)] = rows.to(cache.dtype)  # −1 is the last slot
