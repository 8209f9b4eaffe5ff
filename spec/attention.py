"""Attention stage: the new tokens' queries against a paged KV cache.

One operation, `paged_attention`, serves every way an engine runs attention
during generation: a decode step (one new token per sequence), a chunk of a
long prompt (chunked prefill), a whole prompt, and the verification of
speculative draft tokens, for a batch whose sequences mix all of these. The
keys and values of every position, the new ones included, are already in the
cache: `decodespec.spec.append.append_kv` writes them there first.

This module computes one sequence at a time, gathering its keys and values
into contiguous tensors: the loop is the definition, not a schedule.
Kernels tile, split and fuse as they like, and must agree within the
registry's relative tolerance.

Layout
------
[ATTN-LAYOUT-1] The cache is paged: `k_cache` and `v_cache` have shape
`[num_blocks, block_size, num_kv_heads, head_dim]`, and position j of
sequence b is stored in block `block_table[b, j // block_size]` at offset
`j % block_size`, that is in row `k_cache[block_table[b, j // block_size],
j % block_size]` (and the same row of `v_cache`). The output depends only on
the logical sequence of keys and values: which physical blocks hold them,
and in which order, is invisible. Several sequences may share a block
(a common prefix); reading is pure.

[ATTN-PACK-1] The queries of all sequences are packed into one tensor `q` of
shape `[num_tokens, num_q_heads, head_dim]`: rows `query_start[b]` to
`query_start[b + 1] − 1` belong to sequence b, so `query_start` holds
`batch + 1` non-decreasing offsets from 0 to `num_tokens`, and
`q_len_b = query_start[b + 1] − query_start[b]`. A sequence may have no rows
in a step (q_len 0); the output has one row per row of `q`, in `q`'s order.

[ATTN-CAUSAL-1] `seq_lens[b]` is sequence b's total length in the cache,
*including* its new tokens, and its query rows are its last `q_len_b`
positions: row r (0-based within the sequence) sits at position
`seq_lens[b] − q_len_b + r` and attends to every position of the sequence
`<=` its own (causal, aligned bottom-right). Decode is `q_len_b = 1` (the row
attends to the whole sequence); a chunk of a prompt or a run of draft tokens
is `q_len_b > 1`; the first chunk of a prompt has `q_len_b = seq_lens[b]`.
`q_len_b <= seq_lens[b]` (but see ATTN-EMPTY-1).

Scores
------
[ATTN-SCALE-1] For a query row at position p and head h, with K and V the
keys and values of positions 0..p of its sequence read from KV head g(h):
`out = softmax(scale · K q) · V`, `s_j = scale · (q · k_j)`, the softmax
subtracting the row's maximum before exponentiating (so no score, however
large, overflows). `scale` is `1 / sqrt(head_dim)` unless given; a given
scale is any finite number and is used as is (models with their own scaling,
such as Gemma's query_pre_attn_scalar, pass it).

[ATTN-GQA-1] Query head h reads KV head `g(h) = h // (num_q_heads //
num_kv_heads)` (grouped-query attention: consecutive query heads share a KV
head; multi-head attention is the ratio 1, multi-query attention
`num_kv_heads = 1`). `num_q_heads` must be a multiple of `num_kv_heads`; any
ratio is allowed, not only powers of two (SmolLM2 has 9 query heads over 3
KV heads).

[ATTN-DTYPE-1] `q`, `k_cache` and `v_cache` share one dtype: float16,
bfloat16, float32 or float64. Scores, softmax and the weighted sum of values
are computed in float32 (float64 for float64 inputs, which is how the
conformance suite evaluates the reference), as SOFTMAX-DTYPE-1; the output
is rounded once, to `q`'s dtype.

[ATTN-LSE-1] With `return_lse=True` the operation also returns the
log-sum-exp of each row's scaled scores, `lse = ln Σ_j exp(s_j)` over the
positions the row attends to (natural logarithm), shape
`[num_tokens, num_q_heads]`, float32 (float64 for float64 inputs). It makes
partial results mergeable: `out = Σ_j exp(s_j − lse) · v_j`, so attention
over disjoint parts of a sequence can be combined exactly (split-KV,
cascade attention).

[ATTN-EMPTY-1] A sequence with `seq_lens[b] = 0` has no keys. It may still
own query rows, any number of them (padding that rounds a batch up to a
captured size, for example): each of its rows yields zeros and log-sum-exp
−inf, and its block table row is not read. This is the one exception to
`q_len_b <= seq_lens[b]`.

Bounds and validation
---------------------
[ATTN-BOUNDS-1] Nothing at or past `seq_lens[b]` is ever read. Of row b of
`block_table` only the first `ceil(seq_lens[b] / block_size)` entries are
read, and they must lie in `[0, num_blocks)`; later entries may hold
anything (−1 is customary). Cache rows that no sequence uses, and the offsets
of a sequence's last block past its length, may hold anything, NaN included,
without changing the output (masking after multiplying is not enough:
NaN · 0 is NaN).

[ATTN-INVARIANT-1] Batch invariance: a sequence's output rows and their
log-sum-exp are bitwise functions of its own arguments — its queries,
`seq_lens[b]`, its query count, the scale and the keys and values its
block-table row points to — whatever else the call holds: the other
sequences (their number, lengths, query counts, blocks), their order, and
the block table's width. An implementation that cuts a sequence's
positions into ranges (split-KV) cuts them at boundaries fixed by nothing
else and merges them in one fixed order, however many programs share the
work. The spec computes each sequence by itself.

[ATTN-VALID-1] Invalid arguments raise `ValueError` naming the argument:
shapes (q 3-D, caches 4-D and equal, head_dim shared, `block_table`
`[batch, max_blocks_per_seq]`, `seq_lens` `[batch]`, `query_start`
`[batch + 1]`), dtypes (float caches of `q`'s dtype, int32 or int64 indices),
devices (all on `q`'s), `num_q_heads % num_kv_heads`, `query_start` starting
at 0, non-decreasing and ending at `num_tokens`, `0 <= seq_lens[b] <=
max_blocks_per_seq · block_size`, `q_len_b <= seq_lens[b]` (ATTN-EMPTY-1
excepted), the block table entries that are read (ATTN-BOUNDS-1), and a
finite `scale`. An argument that is not a `torch.Tensor` at all (a Python
number, a list) raises `TypeError` naming it instead, for example "seq_lens
must be a torch.Tensor, got list" (the spec's `ArgumentTypeError`, also a
`ValueError`, SOFTMAX-VALID-1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .softmax import check_tensor, compute_dtype

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(name: str, t: Tensor, shape: list[int], device: torch.device) -> None:
    """Raise ValueError naming `name` unless `t` is an int32/int64 tensor of `shape` on `device`
    (TypeError, `ArgumentTypeError`, if it is no tensor at all)."""
    check_tensor(name, t)
    if list(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_cache_pair(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int, int]:
    """Validate the two caches (equal 4-D shapes, one float dtype, one device).

    Returns:
        `(num_blocks, block_size, num_kv_heads, head_dim)`.
    """
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must have shape [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {list(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache must have k_cache's shape {list(k_cache.shape)}, got {list(v_cache.shape)}"
        )
    if not k_cache.dtype.is_floating_point:
        raise ValueError(f"k_cache must have a floating-point dtype, got {k_cache.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (slots are rows of a flat view)")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            f"k_cache must have block_size, num_kv_heads and head_dim >= 1, "
            f"got shape {list(k_cache.shape)}"
        )
    return num_blocks, block_size, num_kv_heads, head_dim


def check_attention_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    scale: float | None,
) -> tuple[list[int], list[int]]:
    """ATTN-VALID-1. Returns `seq_lens` and `query_start` as Python lists."""
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start", query_start),
    ):
        check_tensor(name, t)
    if q.dim() != 3:
        raise ValueError(
            f"q must have shape [num_tokens, num_q_heads, head_dim], got {list(q.shape)}"
        )
    if q.dtype not in ATTENTION_DTYPES:
        raise ValueError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_q_heads < 1 or head_dim < 1:
        raise ValueError(f"q must have num_q_heads and head_dim >= 1, got {list(q.shape)}")
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache must have q's dtype {q.dtype}, got {k_cache.dtype}")
    if k_cache.device != q.device:
        raise ValueError(f"k_cache is on {k_cache.device}, q on {q.device}")
    num_blocks, block_size, num_kv_heads, kv_head_dim = check_cache_pair(k_cache, v_cache)
    if kv_head_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {kv_head_dim}, q has head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"q has num_q_heads={num_q_heads}, which must be a multiple of "
            f"k_cache's num_kv_heads={num_kv_heads}"
        )
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must have shape [batch], got {list(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    check_index_tensor("seq_lens", seq_lens, [batch], q.device)
    check_index_tensor("query_start", query_start, [batch + 1], q.device)
    if block_table.dim() != 2:
        raise ValueError(
            f"block_table must have shape [batch, max_blocks_per_seq], "
            f"got {list(block_table.shape)}"
        )
    max_blocks = block_table.shape[1]
    check_index_tensor("block_table", block_table, [batch, max_blocks], q.device)
    if scale is not None and not (
        isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")

    lens = seq_lens.tolist()
    starts = query_start.tolist()
    capacity = max_blocks * block_size
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity:
            raise ValueError(
                f"seq_lens[{b}] = {n} must be in [0, {capacity}] "
                f"(max_blocks_per_seq {max_blocks} × block_size {block_size})"
            )
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_start must start at 0 and end at num_tokens={num_tokens}, "
            f"got {starts[0]} ... {starts[-1]}"
        )
    for b in range(batch):
        q_len = starts[b + 1] - starts[b]
        if q_len < 0:
            raise ValueError(
                f"query_start must be non-decreasing, got query_start[{b}] = {starts[b]} > "
                f"query_start[{b + 1}] = {starts[b + 1]}"
            )
        if lens[b] > 0 and q_len > lens[b]:
            raise ValueError(
                f"query_start gives sequence {b} {q_len} query rows, more than its "
                f"seq_lens[{b}] = {lens[b]} positions"
            )
    # The entries that are read: the first ceil(seq_len / block_size) of each row.
    used = torch.arange(max_blocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} must be in [0, {num_blocks}) "
            f"(sequence {b} has {lens[b]} positions in blocks of {block_size})"
        )
    return lens, starts


def sequence_slots(block_table_row: Tensor, seq_len: int, block_size: int) -> Tensor:
    """Flat cache slots of positions 0..seq_len−1 of one sequence (ATTN-LAYOUT-1).

    Position j lives in block `block_table_row[j // block_size]` at offset
    `j % block_size`, that is at flat slot `block · block_size + offset` of
    the cache viewed as `[num_blocks · block_size, num_kv_heads, head_dim]`.
    Only the table entries of those positions are read (ATTN-BOUNDS-1).
    """
    used_blocks = block_table_row[: -(-seq_len // block_size)].to(torch.int64)
    offsets = torch.arange(block_size, device=block_table_row.device)
    return (used_blocks[:, None] * block_size + offsets).flatten()[:seq_len]


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
    """Causal attention of packed queries over a paged KV cache.

    (ATTN-LAYOUT-1, ATTN-PACK-1, ATTN-CAUSAL-1, ATTN-SCALE-1, ATTN-GQA-1,
    ATTN-DTYPE-1, ATTN-LSE-1, ATTN-EMPTY-1, ATTN-BOUNDS-1, ATTN-VALID-1.)

    Args:
        q: `[num_tokens, num_q_heads, head_dim]`, float16, bfloat16, float32
            or float64: the queries of every sequence's new tokens, packed.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, q's dtype.
        v_cache: same shape and dtype as `k_cache`.
        block_table: `[batch, max_blocks_per_seq]` int32/int64; entry (b, i)
            is the block holding positions `i·block_size ...` of sequence b.
        seq_lens: `[batch]` int32/int64, each sequence's length including
            its new tokens.
        query_start: `[batch + 1]` int32/int64, offsets of each sequence's
            rows in `q`.
        scale: multiplies the dot products; `1 / sqrt(head_dim)` if None.
        return_lse: also return the log-sum-exp of each row's scaled scores.
        validate: check the arguments (ATTN-VALID-1). A caller that runs many
            layers over one batch layout checks it once and passes False for
            the other layers; unchecked bad arguments are undefined behaviour.

    Returns:
        `out`, `[num_tokens, num_q_heads, head_dim]` in q's dtype; with
        `return_lse`, `(out, lse)`, lse `[num_tokens, num_q_heads]` float32
        (float64 for float64 inputs).

    Raises:
        ValueError: an argument has the wrong shape, dtype, device or value
            (ATTN-VALID-1); the message names it.
        TypeError: an argument that must be a tensor is not (ATTN-VALID-1);
            the message names it.

    Example:
        Two positions in blocks of one slot, stored in reverse order. Zero
        queries score every key equally: row 0 (position 0) sees only the
        first value, row 1 (position 1) averages both.

        >>> k_cache = torch.tensor([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])  # [2, 1, 1, 2]
        >>> v_cache = torch.tensor([[[[1.0, 2.0]]], [[[3.0, 4.0]]]])
        >>> out, lse = paged_attention(
        ...     torch.zeros(2, 1, 2), k_cache, v_cache,
        ...     block_table=torch.tensor([[1, 0]]), seq_lens=torch.tensor([2]),
        ...     query_start=torch.tensor([0, 2]), return_lse=True)
        >>> out[:, 0]
        tensor([[3., 4.],
                [2., 3.]])
        >>> lse[:, 0]
        tensor([0.0000, 0.6931])
    """
    if validate:
        lens, starts = check_attention_args(
            q, k_cache, v_cache, block_table, seq_lens, query_start, scale
        )
    else:
        lens, starts = seq_lens.tolist(), query_start.tolist()
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    acc = compute_dtype(q.dtype)
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)

    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=acc, device=q.device)
    lse = torch.full(
        (num_tokens, num_q_heads) if return_lse else (0,), -math.inf, dtype=acc, device=q.device
    )
    for b, seq_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0 or seq_len == 0:  # no rows, or no keys (ATTN-EMPTY-1): zeros, −inf
            continue
        slots = sequence_slots(block_table[b], seq_len, block_size)
        # [num_kv_heads, seq_len, head_dim]: only this sequence's positions are read.
        keys = flat_k.index_select(0, slots).to(acc).transpose(0, 1)
        values = flat_v.index_select(0, slots).to(acc).transpose(0, 1)
        # ATTN-GQA-1: query head h = kv · group + g reads KV head kv = h // group, so
        # the group's query heads (of every row) form the rows of one matmul per KV head.
        queries = q[start:end].to(acc).view(q_len, num_kv_heads, group, head_dim)
        queries = queries.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)

        # s[kv, g·q_len + r, j] = scale · (q_r,h · k_j,kv)
        scores = scale * (queries @ keys.transpose(1, 2))
        if q_len > 1:  # a single row (decode) sits at the last position and sees them all
            row_position = seq_len - q_len + torch.arange(q_len, device=q.device)
            key_position = torch.arange(seq_len, device=q.device)
            visible = key_position[None, :] <= row_position[:, None]  # ATTN-CAUSAL-1
            scores = scores.masked_fill(~visible.repeat(group, 1), -math.inf)

        probs = scores.softmax(dim=-1)  # max-subtracted: exp never overflows (ATTN-SCALE-1)
        rows = probs @ values  # [num_kv_heads, group · q_len, head_dim]
        out[start:end] = (
            rows.view(num_kv_heads, group, q_len, head_dim)
            .permute(2, 0, 1, 3)
            .reshape(q_len, num_q_heads, head_dim)
        )
        if return_lse:  # ATTN-LSE-1; finite: every row sees position 0
            row_lse = torch.logsumexp(scores, dim=-1).view(num_kv_heads, group, q_len)
            lse[start:end] = row_lse.permute(2, 0, 1).reshape(q_len, num_q_heads)

    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
