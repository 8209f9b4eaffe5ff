"""Append stage: write the new tokens' keys and values into the paged KV cache.

Each step of the decode loop computes keys and values for its new tokens
(one per sequence when decoding, a whole chunk when prefilling) and stores
them in the cache before attention reads them (ATTN-CAUSAL-1). The engine's
block allocator decides where: `slot_mapping` gives each new token a flat
slot in the cache.

[APPEND-SLOT-1] Row t of `key` and `value` goes to the flat slot
`s = slot_mapping[t]`, that is block `s // block_size`, offset
`s % block_size`: `k_cache[s // block_size, s % block_size] = key[t]` and
the same for `v_cache` and `value[t]`. The copy is exact: values are cast to
the cache's dtype (rounding to nearest, ties to even, as `Tensor.to` does),
so a row already in the cache's dtype is stored bit for bit. For position j
of sequence b the engine uses `s = block_table[b, j // block_size] ·
block_size + j % block_size`, where `paged_attention` will look for it
(ATTN-LAYOUT-1).

[APPEND-SKIP-1] A slot of −1 skips its row: nothing is written for it
(padding tokens of a batch rounded up to a captured size, or tokens whose
keys an engine does not keep).

[APPEND-STATE-1] `append_kv` writes into `k_cache` and `v_cache` in place and
returns None. It is the only operation of the spec with a side effect,
because the cache is the state the decode loop carries from one step to the
next. Every slot that `slot_mapping` does not name keeps its contents bit for
bit, whatever they are (NaN included).

[APPEND-VALID-1] Invalid arguments raise `ValueError` naming the argument,
before anything is written (a rejected call leaves both caches unchanged):
`key` and `value` `[num_tokens, num_kv_heads, head_dim]` with the caches'
heads and head_dim and a floating-point dtype; the caches as in
ATTN-VALID-1 (equal 4-D shapes, one floating-point dtype); `slot_mapping`
`[num_tokens]` int32 or int64; every tensor on the caches' device; every
slot in `[−1, num_blocks · block_size)`; no slot other than −1 named twice
(the result would depend on the order of the writes). An argument that is not
a `torch.Tensor` at all (a Python number, a list) raises `TypeError` naming it
instead, for example "slot_mapping must be a torch.Tensor, got list" (the
spec's `ArgumentTypeError`, also a `ValueError`, SOFTMAX-VALID-1), and nothing
is written either.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .attention import check_cache_pair, check_index_tensor
from .softmax import check_tensor


def check_append_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Check `append_kv`'s arguments (APPEND-VALID-1) without writing anything.

    `append_kv` calls it unless `validate=False`; an engine that appends many
    layers with one slot mapping, or writes the cache its own way, calls it
    once per step to get the spec's checks and messages.

    Checks, in this order: every argument is a `torch.Tensor`; the caches
    have equal 4-D shapes `[num_blocks, block_size, num_kv_heads, head_dim]`,
    one floating-point dtype, one device and are contiguous (ATTN-VALID-1);
    `key` and `value` are `[num_tokens, num_kv_heads, head_dim]` with the
    caches' heads and head_dim, a floating-point dtype and on the caches'
    device, `value` of `key`'s shape; `slot_mapping` is `[num_tokens]` int32
    or int64 on the caches' device, every slot is −1 or in
    `[0, num_blocks · block_size)`, and no slot other than −1 is named twice.

    Args:
        key: the new tokens' keys, as for `append_kv`.
        value: the new tokens' values, as for `append_kv`.
        k_cache: the key cache, as for `append_kv`; only read.
        v_cache: the value cache, as for `append_kv`; only read.
        slot_mapping: each token's flat slot, −1 to skip it.

    Returns:
        None: the arguments are valid.

    Raises:
        ValueError: an argument has the wrong shape, dtype, device or value,
            or a slot is out of range or named twice; the message names the
            argument.
        TypeError: an argument is not a tensor (the spec's
            `ArgumentTypeError`, also a `ValueError`); the message names it.
    """
    for name, t in (
        ("key", key),
        ("value", value),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("slot_mapping", slot_mapping),
    ):
        check_tensor(name, t)
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or list(t.shape[1:]) != [num_kv_heads, head_dim]:
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}] "
                f"(num_kv_heads and head_dim of k_cache), got {list(t.shape)}"
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must have a floating-point dtype, got {t.dtype}")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device}, k_cache on {k_cache.device}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {list(key.shape)}, got {list(value.shape)}")
    check_index_tensor("slot_mapping", slot_mapping, [key.shape[0]], k_cache.device)
    num_slots = num_blocks * block_size
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"slot_mapping[{t}] = {int(slot_mapping[t])} must be -1 (skip) or a slot in "
            f"[0, {num_slots}) (num_blocks {num_blocks} × block_size {block_size})"
        )
    slots = slot_mapping[slot_mapping >= 0]
    if slots.numel() < 2:
        return
    unique, counts = slots.unique(return_counts=True)
    if bool((counts > 1).any()):
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

    (APPEND-SLOT-1, APPEND-SKIP-1, APPEND-STATE-1, APPEND-VALID-1.)

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`, any floating dtype.
        value: same shape as `key`, any floating dtype.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, written
            in place.
        v_cache: same shape and dtype as `k_cache`, written in place.
        slot_mapping: `[num_tokens]` int32/int64, flat slot
            `block · block_size + offset` of each token, −1 to skip it.
        validate: check the arguments (APPEND-VALID-1); a caller appending
            many layers with one slot mapping checks it once. Unchecked bad
            arguments are undefined behaviour.

    Returns:
        None: the caches are the output.

    Raises:
        ValueError: an argument has the wrong shape, dtype, device or value
            (APPEND-VALID-1); the message names it. Nothing is written.
        TypeError: an argument is not a tensor (APPEND-VALID-1); the message
            names it. Nothing is written.

    Example:
        Two blocks of two slots; token 0 goes to slot 3 (block 1, offset 1),
        token 1 is padding, token 2 goes to slot 0.

        >>> k_cache = torch.full((2, 2, 1, 1), float("nan"))
        >>> v_cache = torch.full((2, 2, 1, 1), float("nan"))
        >>> key = torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1)
        >>> append_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1, 0]))
        >>> k_cache.flatten(), v_cache.flatten()
        (tensor([3., nan, nan, 1.]), tensor([-3., nan, nan, -1.]))
    """
    if validate:
        check_append_args(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    kept = slot_mapping >= 0  # APPEND-SKIP-1
    slots = slot_mapping[kept].to(torch.int64)
    # Slot s is row s of the cache viewed as [num_blocks · block_size, heads, dim]:
    # block s // block_size, offset s % block_size (APPEND-SLOT-1).
    for cache, rows in ((k_cache, key), (v_cache, value)):
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat.index_copy_(0, slots, rows[kept].to(cache.dtype))
