"""KV append: write each new token's K and V rows into its slot of the paged cache.

Same name, signature and semantics as `decodespec.spec.append.append_kv` (APPEND-SLOT-1,
APPEND-SKIP-1, APPEND-STATE-1, APPEND-VALID-1). One program per token copies
its `num_kv_heads · head_dim` values of K and of V; slot −1 (padding) writes
nothing. The cast to the cache dtype happens in the wrapper with PyTorch's
round-to-nearest-even (the Triton interpreter truncates float32 → bfloat16),
so the kernel only moves bits and the result is exact on every backend.

Host syncs and error words (issue 59): the host checks what it knows (shapes,
dtypes, devices); the kernel checks each slot, writes nothing for one outside
`[-1, num_blocks · block_size)` (so no value of `slot_mapping` writes outside the
caches) and sets `ERROR_SLOT_OUT_OF_RANGE` in the token's error word. Duplicate
slots are not memory-unsafe and a kernel cannot see them in one pass of one
program a token: with `errors=` they are the caller's contract (which write wins
is undefined); without it the wrapper checks them with the slot range, on the
device, in its one read (`append_kv`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import INDEX_DTYPES, check_caches, check_tensor, error_words

# Bits of a token's error word (0: fine).
ERROR_SLOT_OUT_OF_RANGE = 1  # its slot is below -1 or past the cache: nothing written
_SLOT_ERROR = tl.constexpr(ERROR_SLOT_OUT_OF_RANGE)  # a global a kernel reads is a constexpr


@triton.jit
def _append_kv_kernel(
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
    # The token's slot in every lane (one address, one cache line); 64-bit because
    # slot · row_size can pass 2^31 in a large cache.
    slot = tl.load(slot_mapping_ptr + token + offsets * 0).to(tl.int64)
    # Slot −1: padding, nothing written; a slot out of range is an error, and nothing
    # is written either, so no value of slot_mapping writes outside the caches.
    in_range = (slot >= -1) & (slot < num_slots)
    word = tl.where(in_range, 0, _SLOT_ERROR)
    tl.store(errors_ptr + token + offsets * 0, word, mask=offsets == 0)  # one writer a token
    mask = (offsets < row_size) & (slot >= 0) & in_range
    head = offsets // head_dim
    dim = offsets % head_dim
    t = token.to(tl.int64)
    key = tl.load(key_ptr + t * key_stride_token + head * key_stride_head + dim, mask=mask)
    value = tl.load(value_ptr + t * value_stride_token + head * value_stride_head + dim, mask=mask)
    tl.store(k_cache_ptr + slot * row_size + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * row_size + offsets, value, mask=mask)


def _check(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """APPEND-VALID-1's host part: shapes, dtypes and devices, each error naming the
    argument. Reads nothing from the device."""
    for name, t in (("key", key), ("value", value), ("slot_mapping", slots)):
        check_tensor(name, t)
    _, _, num_kv_heads, head_dim = check_caches(k_cache, v_cache)
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


def _slots_are_bad(slots: Tensor, num_slots: int) -> Tensor:
    """A 0-d bool tensor, computed on the device without a sync: a slot out of
    `[-1, num_slots)`, or a slot other than −1 named twice (sorted, after giving each
    −1 a distinct negative key)."""
    skip_keys = -2 - torch.arange(slots.shape[0], device=slots.device, dtype=slots.dtype)
    keys = torch.where(slots == -1, skip_keys, slots).sort().values
    out_of_range = ((slots < -1) | (slots >= num_slots)).any()
    return out_of_range | (keys[1:] == keys[:-1]).any()


def _explain(slots: Tensor, num_blocks: int, block_size: int) -> None:
    """APPEND-VALID-1's value part, with the message naming the slot (reads the device)."""
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
    errors: Tensor | None = None,
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
        validate: check the arguments' shapes, dtypes and devices first (on the
            host; no device read), and, when `errors` is None, their values.
        errors: `[num_tokens]` int32, contiguous, on the caches' device, or None.
            Given, the kernel writes each token's error word there (0, or
            `ERROR_SLOT_OUT_OF_RANGE`: that token wrote nothing; the others were
            written) and the wrapper reads nothing: the caller reads the words
            when it chooses. Duplicate slots are then the caller's contract (which
            write wins is undefined; neither writes outside the caches).

    Returns:
        None: the caches are the output.

    Raises:
        ValueError: a wrong shape, dtype, device or (when `errors` is None) slot,
            duplicates included; nothing is written.
        TypeError: an argument that is not a tensor; nothing is written.

    Cost (tests/kernels/test_contracts_attention.py): with `errors` given, 0 host
    syncs, 1 launch (0 for no token), and at most 2 small torch ops (the casts of
    `key` and `value` to the cache's dtype, or copies of them to a unit stride on
    head_dim, each only when needed). With `errors` None and `validate`: 1 sync,
    before the launch (APPEND-VALID-1: a rejected call writes nothing), and 12 more
    small ops for the range and duplicate check (`_slots_are_bad`).

    Example:
        >>> k_cache = torch.zeros(2, 2, 1, 1); v_cache = torch.zeros(2, 2, 1, 1)
        >>> key = torch.tensor([1.0, 2.0]).reshape(2, 1, 1)
        >>> append_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1]))
        >>> k_cache.flatten().tolist()
        [0.0, 0.0, 0.0, 1.0]
    """
    if validate:
        _check(key, value, k_cache, v_cache, slot_mapping)
    num_tokens = key.shape[0]
    words = error_words(errors, num_tokens, k_cache.device)
    if validate and errors is None and num_tokens:
        # The one sync, before any write: the range and the duplicates, on the device.
        num_blocks, block_size = k_cache.shape[:2]
        if bool(_slots_are_bad(slot_mapping, num_blocks * block_size)):
            _explain(slot_mapping, num_blocks, block_size)
            raise RuntimeError("the slot check found an error that _explain does not")
    _launch(_append_kv_kernel, key, value, k_cache, v_cache, slot_mapping, words)


def _launch(
    kernel: triton.JITFunction,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    errors: Tensor,
) -> None:
    """Launch `kernel` (the append kernel's signature) on checked arguments, one program
    a token, writing each token's error word to `errors`."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    # Exact rounding to the cache dtype, and a unit stride on head_dim, before the copy:
    # one copy of each at most, none when both hold already.
    if key.dtype != k_cache.dtype or key.stride(-1) != 1:
        key = key.to(k_cache.dtype, memory_format=torch.contiguous_format)
    if value.dtype != v_cache.dtype or value.stride(-1) != 1:
        value = value.to(v_cache.dtype, memory_format=torch.contiguous_format)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    row_size = num_kv_heads * head_dim
    kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        errors,
        num_blocks * block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        head_dim,
        row_size,
        BLOCK=triton.next_power_of_2(row_size),
    )
