"""The native step's attention and KV append as the stage contract's operations.

`native_step.NativeStep` runs a layer's attention as one C call (`attention`
in `native_step.c`): the new rows' RoPE, then `append_kv`, then
`paged_attention`, both of them entry points of the same library
(`native_attention.c`). This
module exposes those two entry points with the spec's names and signatures
(ARCHITECTURE.md, "The stage contract"), validation in Python, so that the
conformance suite checks the very loops the engine's decode step runs:

    pytest tests/conformance --impl decodespec.reference.native_attention

What the C code covers, against what the contract allows:

- `paged_attention` computes float32 only (the engine's residual stream and
  KV cache are float32). float16, bfloat16 and float64 inputs raise
  `NotImplementedError` naming the dtype, and `CONFORMANCE_UNSUPPORTED`
  declares them, so their tests skip with that reason. Everything else is
  covered: any block size, head_dim, GQA ratio, scale, q_len (decode,
  chunks, prompts), sequences without keys, int32 or int64 indices, and
  the log-sum-exp output.
- `append_kv` copies bytes: each row is first rounded to the cache's dtype
  by `Tensor.to` (APPEND-SLOT-1's rounding), so every floating dtype works.
- CPU tensors only (the loops address host memory): another device raises
  `ValueError`, as the spec's own check of a mismatched device does.

When the library cannot be built or loaded (no compiler, an unwritable or
noexec cache directory), each call raises `native_library.NativeUnavailable`,
a `RuntimeError` saying why.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from decodespec.spec.append import check_append_args
from decodespec.spec.attention import check_attention_args

from .native_library import library

CONFORMANCE_UNSUPPORTED = {
    dtype: "the native step's C attention computes float32 only (the engine's KV cache)"
    for dtype in ("float16", "bfloat16", "float64")
}


def _require_cpu(**tensors: Tensor) -> None:
    """ValueError naming the first tensor not in host memory (the C loops read it there)."""
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: the native step's C code runs on the CPU")


def _indices(t: Tensor) -> Tensor:
    """An index tensor as the C code reads it: contiguous int64."""
    return t.to(torch.int64).contiguous()


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
    """Causal attention of packed queries over a paged KV cache, in the native step's C.

    The operation, arguments, results and errors of
    `decodespec.spec.attention.paged_attention` (ATTN-LAYOUT-1 ... ATTN-VALID-1),
    restricted to float32 on the CPU. Each query row and head is one loop over
    its sequence's positions: scores, their maximum, exponentials and the
    weighted sum of values, all in float32, in an order fixed by the row alone
    (ATTN-INVARIANT-1); the engine's decode step runs the same function.

    Args:
        q: `[num_tokens, num_q_heads, head_dim]` float32.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]` float32, contiguous.
        v_cache: same shape and dtype as `k_cache`.
        block_table: `[batch, max_blocks_per_seq]` int32/int64.
        seq_lens: `[batch]` int32/int64, each sequence's length including its new tokens.
        query_start: `[batch + 1]` int32/int64, offsets of each sequence's rows in `q`.
        scale: multiplies the dot products (rounded to float32); `1 / sqrt(head_dim)`
            if None.
        return_lse: also return each row's log-sum-exp (`[num_tokens, num_q_heads]`
            float32).
        validate: check the arguments (ATTN-VALID-1); the dtype and device checks
            the C code depends on run either way.

    Returns:
        `out` `[num_tokens, num_q_heads, head_dim]` float32, or `(out, lse)`.

    Raises:
        ValueError, TypeError: as the spec's (ATTN-VALID-1); also a tensor that
            is not on the CPU.
        NotImplementedError: q (and so the caches) is not float32.
        native_library.NativeUnavailable: the C library cannot be built or loaded.

    Example:
        >>> k_cache = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # [2, 1, 1, 2]
        >>> v_cache = torch.tensor([[[[1.0, 2.0]]], [[[3.0, 4.0]]]])
        >>> out = paged_attention(
        ...     torch.zeros(2, 1, 2), k_cache, v_cache, block_table=torch.tensor([[1, 0]]),
        ...     seq_lens=torch.tensor([2]), query_start=torch.tensor([0, 2]))
        >>> out[:, 0]
        tensor([[3., 4.],
                [2., 3.]])
    """
    if validate:
        check_attention_args(q, k_cache, v_cache, block_table, seq_lens, query_start, scale)
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise NotImplementedError(
            f"the native step's paged_attention computes float32 only, got q of {q.dtype} "
            "(the spec allows float16, bfloat16 and float64 too)"
        )
    _require_cpu(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                 seq_lens=seq_lens, query_start=query_start)  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q = q.contiguous()
    table, lens_, starts = (_indices(t) for t in (block_table, seq_lens, query_start))
    out = torch.empty(num_tokens, num_q_heads, head_dim)
    lse = torch.empty(num_tokens, num_q_heads) if return_lse else None
    threads = torch.get_num_threads()  # tiles of query tokens split among them
    failed = library().paged_attention(
        q.data_ptr(), num_q_heads * head_dim, num_q_heads, num_kv_heads, head_dim, scale,
        k_cache.data_ptr(), v_cache.data_ptr(), block_size, table.data_ptr(), table.shape[1],
        lens_.data_ptr(), starts.data_ptr(), lens_.shape[0],
        out.data_ptr(), None if lse is None else lse.data_ptr(), threads,
    )  # fmt: skip
    if failed:
        raise MemoryError("the native paged_attention could not allocate its scratch")
    return (out, lse) if return_lse else out


def append_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """Write each token's key and value to its slot of the paged cache, in the native
    step's C.

    The operation, arguments and errors of `decodespec.spec.append.append_kv`
    (APPEND-SLOT-1 ... APPEND-VALID-1), on the CPU: the rows are rounded to the
    cache's dtype here (`Tensor.to`, round to nearest even), then the C loop
    copies each row's bytes to its slot and skips slot −1.

    Args:
        key: `[num_tokens, num_kv_heads, head_dim]`, any floating dtype.
        value: same shape as `key`.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous,
            written in place.
        v_cache: same shape and dtype as `k_cache`, written in place.
        slot_mapping: `[num_tokens]` int32/int64, flat slots, −1 to skip a row.
        validate: check the arguments (APPEND-VALID-1); the device check runs
            either way.

    Returns:
        None: the caches are the output.

    Raises:
        ValueError, TypeError: as the spec's (APPEND-VALID-1), nothing written;
            also a tensor that is not on the CPU.
        native_library.NativeUnavailable: the C library cannot be built or loaded.

    Example:
        >>> k_cache = torch.full((2, 2, 1, 1), float("nan"))
        >>> v_cache = torch.full((2, 2, 1, 1), float("nan"))
        >>> key = torch.tensor([1.0, 2.0, 3.0]).reshape(3, 1, 1)
        >>> append_kv(key, -key, k_cache, v_cache, torch.tensor([3, -1, 0]))
        >>> k_cache.flatten(), v_cache.flatten()
        (tensor([3., nan, nan, 1.]), tensor([-3., nan, nan, -1.]))
    """
    if validate:
        check_append_args(key, value, k_cache, v_cache, slot_mapping)
    _require_cpu(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)  # fmt: skip
    rows = [t.to(k_cache.dtype).contiguous() for t in (key, value)]
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    slots = _indices(slot_mapping)
    library().append_kv(
        rows[0].data_ptr(), row_bytes, rows[1].data_ptr(), row_bytes,
        k_cache.data_ptr(), v_cache.data_ptr(), row_bytes, slots.data_ptr(), slots.shape[0],
    )  # fmt: skip
