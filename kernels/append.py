"""KV append: write each new token's K and V rows into its slot of the paged cache.

Same name, signature and semantics as `decodespec.spec.append.append_kv` (APPEND-SLOT-1,
APPEND-SKIP-1, APPEND-STATE-1, APPEND-VALID-1). One program per token copies
its `num_kv_heads · head_dim` values of K and of V; slot −1 (padding) writes
nothing. The cast to the cache dtype happens in the wrapper with PyTorch's
round-to-nearest-even (the Triton interpreter truncates float32 → bfloat16),
so the kernel only moves bits and the result is exact on every backend.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .checks import INDEX_DTYPES, check_caches, check_tensor


@triton.jit
def _append_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
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
    # The token's slot in every lane (one address, one cache line); 64-bit because
    # slot · row_size can pass 2^31 in a large cache.
    slot = tl.load(slot_mapping_ptr + token + offsets * 0).to(tl.int64)
    mask = (offsets < row_size) & (slot >= 0)  # slot −1: padding, nothing written
    head = offsets // head_dim
    dim = offsets % head_dim
    t = token.to(tl.int64)
    key = tl.load(key_ptr + t * key_stride_token + head * key_stride_head + dim, mask=mask)
    value = tl.load(value_ptr + t * value_stride_token + head * value_stride_head + dim, mask=mask)
    tl.store(k_cache_ptr + slot * row_size + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * row_size + offsets, value, mask=mask)


def _check(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """APPEND-VALID-1: every check before any write, each error naming the argument."""
    for name, t in (("key", key), ("value", value), ("slot_mapping", slots)):
        check_tensor(name, t)
    num_blocks, block_size, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
    for name, t in (("key", key), ("value", value), ("v_cache", v_cache), ("slot_mapping", slots)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or list(t.shape[1:]) != [num_kv_heads, head_dim]:
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] "
                f"(num_kv_heads and head_dim of k_cache), got {list(t.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {list(key.shape)}, got {list(value.shape)}")
    if slots.dtype not in INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slots.dtype}")
    if list(slots.shape) != [key.shape[0]]:
        raise ValueError(f"slot_mapping must have shape [{key.shape[0]}], got {list(slots.shape)}")
    num_slots = num_blocks * block_size
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < -1 or high >= num_slots:
            bad = int(low if low < -1 else high)
            raise ValueError(
                f"slot_mapping holds {bad}: entries must be -1 (skip) or a slot in "
                f"[0, {num_slots}) (num_blocks {num_blocks} × block_size {block_size})"
            )
        used = slots[slots >= 0]
        if used.numel() > 1 and used.unique().numel() != used.numel():
            unique, counts = used.unique(return_counts=True)
            raise ValueError(
                f"slot_mapping names slots {unique[counts > 1].tolist()} more than once; "
                "the cache would depend on the order of the writes"
            )


def append_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write each token's key and value to its slot of the paged cache, in place.

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`, any floating dtype (the
            last dimension contiguous or not: strides are honoured).
        value: same shape as `key`.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, float16,
            bfloat16, float32 or float64, contiguous; written in place.
        v_cache: same shape and dtype as `k_cache`; written in place.
        slot_mapping: `[num_tokens]` int32/int64: flat slot
            `block · block_size + offset` of each token, −1 to skip it.
        validate: check the arguments first (once per batch is enough).

    Returns:
        None: the caches are the output.

    Raises:
        ValueError: a wrong shape, dtype, device or slot; nothing is written.
        TypeError: an argument that is not a tensor; nothing is written.

    Example:
        >>> k_cache = torch.zeros(2, 2, 1, 1); v_cache = torch.zeros(2, 2, 1, 1)
        >>> key = torch.tensor([1.0, 2.0]).reshape(2, 1, 1)
        >>> append_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1]))
        >>> k_cache.flatten().tolist()
        [0.0, 0.0, 0.0, 1.0]
    """
    if validate:
        _check(key, value, k_cache, v_cache, slot_mapping)
    _launch(_append_kv_kernel, key, value, k_cache, v_cache, slot_mapping)


def _launch(
    kernel: triton.JITFunction,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> None:
    """Launch `kernel` (the append kernel's signature) on checked arguments, one program
    a token."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # Exact rounding to the cache dtype, and a unit stride on head_dim, before the copy.
    key = key.to(k_cache.dtype)
    value = value.to(v_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _, _, num_kv_heads, head_dim = k_cache.shape
    row_size = num_kv_heads * head_dim
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        head_dim,
        row_size,
        BLOCK=triton.next_power_of_2(row_size),
    )
