"""KV append kernel whose store mask forgets `slot >= 0`: a padding token (slot −1)
is written to `cache + (−1) · row_size`, the row just before the cache's memory.
Breaks APPEND-SKIP-1 outside the cache, where comparing the cache finds nothing; the
conformance suite allocates each cache inside a larger buffer with guard blocks
around it, so the stray write fails an assertion (the clean-failures family)
instead of corrupting the Triton interpreter's heap.

Only the kernel is a copy of `decodespec.kernels.append`'s: the argument checks
and the launch are that module's own `_check` and `_launch`.
"""

import triton
import triton.language as tl

from decodespec.kernels import append


@triton.jit
def _append_kv_kernel_without_skip(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    errors_ptr,
    num_slots,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    head_dim,
    row_size,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    slot = tl.load(slot_mapping_ptr + token + offsets * 0).to(tl.int64)
    in_range = (slot >= -1) & (slot < num_slots)
    tl.store(errors_ptr + token + offsets * 0, tl.where(in_range, 0, 1), mask=offsets == 0)
    mask = (offsets < row_size) & in_range  # the mutation: `& (slot >= 0)` is gone
    head = offsets // head_dim
    dim = offsets % head_dim
    t = token.to(tl.int64)
    key = tl.load(key_ptr + t * key_stride_token + head * key_stride_head + dim, mask=mask)
    value = tl.load(value_ptr + t * value_stride_token + head * value_stride_head + dim, mask=mask)
    tl.store(k_cache_ptr + slot * row_size + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * row_size + offsets, value, mask=mask)


def append_kv(key, value, k_cache, v_cache, slot_mapping, *, validate=True, errors=None) -> None:
    if validate:
        append._check(key, value, k_cache, v_cache, slot_mapping)
    words = append.error_words(errors, key.shape[0], k_cache.device)
    kernel = _append_kv_kernel_without_skip
    append._launch(kernel, key, value, k_cache, v_cache, slot_mapping, words)
