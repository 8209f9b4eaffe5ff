"""Paged attention in Triton: packed queries of many sequences over a paged KV cache.

Same name, signature and semantics as `decodespec.spec.attention.paged_attention`
(ATTN-LAYOUT-1 ... ATTN-VALID-1), plus one keyword, `num_splits`. One
operation serves decode (one query row per sequence), chunked prefill and
speculative verification (several rows, causal, aligned bottom-right), mixed
freely in one batch.

How the work is cut
-------------------
A program owns one *tile*: up to `BLOCK_Q` consecutive query rows of one
sequence, times the `group = num_q_heads // num_kv_heads` query heads that
share one KV head. Rows and heads are packed into the `BLOCK_M` rows of the
matrix products (`m = row · group + head`), so every K/V tile loaded from the
cache serves all of them, and `tl.dot` gets the 16 rows it needs even for a
decode row of a small group. Non-power-of-two groups (SmolLM2: 9 query heads
over 3 KV heads) and head dims (80, 96) are padded up and masked.

A sequence's tile shape depends on its own `q_len` only (and the group, head
dim and dtype), never on the batch: on a GPU the shape changes a row's last
bits (an H200 showed it). Sequences whose rows fit one 16-row tile (decode,
short speculative verification) get one, in a launch of one program per
sequence; longer ones (prefill chunks) get 64-row tiles, so each K/V tile
loaded serves more rows, in a second launch that numbers tiles without a host
sync: sequence b owns the tiles from `query_start[b] // BLOCK_Q + b`, which
leaves room for `ceil(q_len_b / BLOCK_Q)` tiles, and a program finds its
sequence by binary search. Programs exit at once on surplus tiles and on the
other launch's sequences.

The program walks its sequence's positions `BLOCK_N` at a time. Each
position's physical row comes from the block table (`block_table[b, j //
block_size] · block_size + j % block_size`), so any block size works, 1
included; positions past the rows' causal limit or the sequence's end are
masked *at the load*, so no value there is read and NaN in unused slots never
reaches the output (ATTN-BOUNDS-1). Scores go through an online softmax in
float32 (float64 for float64 inputs), base 2 with the scale folded into
`log2(e)`.

Split-KV (flash-decoding), batch invariant
------------------------------------------
With a long context and few tiles (decode of a small batch), several programs
may share a tile's positions. How many is a matter of speed alone: a row's
output and lse are *bitwise* a function of its own sequence (q, keys, values,
seq_len, q_len), whatever the split count, the other sequences in the call or
the block table's width (batch invariance, issue 40: a request's tokens must
not depend on its batch). The plan is FlashInfer's and batch_invariant_ops':
fixed-size chunks. Positions are cut at fixed boundaries into chunks of
`KV_CHUNK`; each chunk gets a fresh online softmax, and the chunk states
(maximum, sum, unnormalised output) are folded in chunk order by one
function, `_fold`. Unsplit, a program folds its chunks in registers; with
`num_splits = S`, program s takes chunks s, s + S, ... and writes each one's
state to a float32 (float64) buffer of `ceil(capacity / KV_CHUNK)` chunks (the
table's capacity), then counts itself in at its tile's arrival counter
(`workspace.py`); the tile's last program folds the chunks in order with
`_fold` and finishes as the unsplit path does, in the same launch. An empty
chunk folds to the same bits, so chunks past a row's limit and the table width
do not matter. The kernel runs without FMA contraction
(`enable_fp_fusion=False`): the compiler must not fuse `L·a + l·b` on one path
and not the other.
`choose_num_splits` picks the count from the number of programs, the GPU's
multiprocessor count and the capacity, without reading any device tensor.

Why one file of some 800 lines: it is one operation, read top to bottom —
the attention kernel, the split planner and the validating wrapper — and a
downstream engine vendors it as one unit beside `checks.py` and `workspace.py`.
Splitting it would separate a kernel from the launch arithmetic that must agree
with it.

No host sync (issue 59): the host checks shapes, dtypes and devices; the values of
`block_table`, `seq_lens` and `query_start` are checked by program (b, 0, 0) of the
short-tile launch, which writes sequence b's error word (`ERROR_*` bits), and a bad
value is masked wherever it is used, so none reads or writes outside a tensor. The
grid comes from shapes and the caller's host metadata (`max_query_len`,
`max_seq_len`), never from a device read (`paged_attention`'s Cost).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import (
    INTERPRET,
    check_caches,
    check_index_tensor,
    check_kernel_device,
    check_tensor,
    error_words,
    raise_for_errors,
)
from .workspace import arrival_counters

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # a global a kernel reads must be a constexpr
# Split-KV: a sequence's positions fall into chunks [c·KV_CHUNK, (c + 1)·KV_CHUNK), a
# multiple of every BLOCK_N; the heuristic gives a tile at most MAX_SPLITS programs.
KV_CHUNK = 512
MAX_SPLITS = 64
MAX_FORCED_SPLITS = 256
# Bits of a sequence's error word (0: fine); a bad value is masked, never followed.
ERROR_BLOCK_ID_OUT_OF_RANGE = 1  # a table entry it reads is outside [0, num_blocks)
ERROR_SEQ_LEN_OUT_OF_RANGE = 2  # seq_lens[b] outside [0, capacity] (or max_seq_len)
ERROR_QUERY_START_INVALID = 4  # decreasing, or not from 0 to num_tokens
ERROR_QUERY_LEN_TOO_LONG = 8  # more rows than positions, or than max_query_len
# Integer arguments that vary from call to call (batch, table width, splits): Triton must
# not compile a variant for each value that is 1 or a multiple of 16.
_RUNTIME_INTS = "batch num_tokens num_splits seq_len_limit max_query_len num_chunks".split()
_RUNTIME_INTS += ["block_table_stride", "chunk_stride", "counter_base"]


# ---------------------------------------------------------------- kernels


@triton.jit
def _find_sequence(query_start_ptr, index, batch, BLOCK_Q: tl.constexpr, PER_TILE: tl.constexpr):
    """The sequence owning tile `index` (PER_TILE: the last b with `query_start[b] //
    BLOCK_Q + b <= index`) or token `index` (the last b with `query_start[b] <= index`)."""
    lo = index * 0
    hi = lo + batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_ptr + mid).to(tl.int32)
        if PER_TILE:
            first = first // BLOCK_Q + mid
        lo = tl.where(first <= index, mid, lo)
        hi = tl.where(first <= index, hi, mid)
    return lo


@triton.jit
def _fold(m_run, l_run, acc_run, m_c, l_c, acc_c, EXP2: tl.constexpr):
    """Fold a chunk's softmax state (maximum in the exponent's base, sum, unnormalised
    output) into the running one: the one place states meet, so that the unsplit path
    and the split tile's last program round alike. An empty chunk (−inf, 0, 0) changes no bit
    (a = 1, b = 0); the first chunk into (−inf, 0, 0) gives its own state (a = 0, b = 1)."""
    m_new = tl.maximum(m_run, m_c)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(−inf − 0) = 0, not NaN
    if EXP2:
        a = tl.exp2(m_run - shift)
        b = tl.exp2(m_c - shift)
    else:
        a = tl.exp(m_run - shift)
        b = tl.exp(m_c - shift)
    return m_new, l_run * a + l_c * b, acc_run * a[:, None] + acc_c * b[:, None]


@triton.jit
def _finish(m_run, l_run, acc_run, EXP2: tl.constexpr):
    """A folded state's output and log-sum-exp; rows without keys (ATTN-EMPTY-1,
    ATTN-LSE-1) give zeros and −inf."""
    seen = l_run > 0
    l_safe = tl.where(seen, l_run, 1.0)
    if EXP2:
        lse = (m_run + tl.log2(l_safe)) * LN2
    else:
        lse = m_run + tl.log(l_safe)
    return acc_run / l_safe[:, None], tl.where(seen, lse, float("-inf"))


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    lse_ptr,
    chunk_m_ptr,
    chunk_l_ptr,
    chunk_acc_ptr,
    counters_ptr,
    errors_ptr,
    qk_scale,
    batch,
    num_tokens,
    num_blocks,
    seq_len_limit,
    max_query_len,
    block_size,
    num_q_heads,
    head_dim,
    num_splits,
    short_q_len,
    q_stride_token,
    q_stride_head,
    cache_stride_slot,
    block_table_stride,
    chunk_stride,
    counter_base,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_CHUNK: tl.constexpr,
    COMPUTE: tl.constexpr,
    EXP2: tl.constexpr,
    FMA_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    ONE_TILE: tl.constexpr,
    SPLIT: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The launch of short sequences (ONE_TILE): tile b is sequence b's only tile.
    seq = tile if ONE_TILE else _find_sequence(query_start_ptr, tile, batch, BLOCK_Q, True)
    first = tl.load(query_start_ptr + seq)  # as stored: checked before they are narrowed
    last = tl.load(query_start_ptr + seq + 1)
    length = tl.load(seq_lens_ptr + seq)
    table_row = block_table_ptr + seq.to(tl.int64) * block_table_stride
    if ONE_TILE:  # program (b, 0, 0) checks sequence b: its error word's one writer
        if (kv_head == 0) & (split == 0):
            # The table entries the sequence reads: the first ceil(seq_len / block_size).
            used = tl.cdiv(tl.minimum(tl.maximum(length, 0), seq_len_limit), block_size)
            bad_block = tl.zeros([BLOCK_N], tl.int32)
            for j in range(0, used, BLOCK_N):
                col = j + tl.arange(0, BLOCK_N)
                block = tl.load(table_row + col, mask=col < used, other=0)
                bad_block = bad_block | ((block < 0) | (block >= num_blocks)).to(tl.int32)
            n = last - first
            bad_start = (n < 0) | ((seq == 0) & (first != 0))
            bad_start = bad_start | ((seq == batch - 1) & (last != num_tokens))
            too_long = ((length > 0) & (n > length)) | (n > max_query_len)
            word = tl.where(tl.max(bad_block, 0) > 0, 1, 0)  # the ERROR_* bits, in order
            word = word | tl.where((length < 0) | (length > seq_len_limit), 2, 0)
            word = word | tl.where(bad_start, 4, 0) | tl.where(too_long, 8, 0)
            tl.store(errors_ptr + seq, word)
    # Bad values are masked, never followed: a clamped seq_len reads only its table row
    # and the chunk buffers' chunks, rows outside q are never read or written (row_valid),
    # blocks outside the caches never read (kv_valid).
    q_start = first.to(tl.int32)
    q_len = last.to(tl.int32) - q_start
    seq_len = tl.minimum(tl.maximum(length, 0), seq_len_limit).to(tl.int32)
    first_row = tile * 0 if ONE_TILE else (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    # A sequence the other launch owns (_launches), or a surplus tile of this one.
    if ((q_len > BLOCK_Q) if ONE_TILE else (q_len <= short_q_len)) | (first_row >= q_len):
        return

    # Matrix row m is query row `first_row + m // GROUP` of the sequence, head `m % GROUP`
    # of the KV head's group.
    m = tl.arange(0, BLOCK_M)
    row = first_row + m // GROUP
    head = kv_head * GROUP + m % GROUP
    token = (q_start + row).to(tl.int64)
    row_valid = (m < BLOCK_Q * GROUP) & (row < q_len) & (token >= 0) & (token < num_tokens)
    out_row = token * num_q_heads + head  # in out, lse and each chunk's slice of the buffers
    position = seq_len - q_len + row  # ATTN-CAUSAL-1: the row sees positions <= this
    d = tl.arange(0, BLOCK_D)
    d_valid = d < head_dim
    q = tl.load(
        q_ptr + token[:, None] * q_stride_token + head[:, None] * q_stride_head + d[None, :],
        mask=row_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(COMPUTE)

    # The positions the tile's last row sees, in chunks at fixed boundaries: this program
    # takes chunks split, split + num_splits, ... (every one when not split).
    kv_end = tl.maximum(seq_len - q_len + tl.minimum(first_row + BLOCK_Q, q_len), 0)
    head_offset = kv_head * head_dim
    m_run = tl.full([BLOCK_M], float("-inf"), COMPUTE)
    l_run = tl.zeros([BLOCK_M], COMPUTE)
    acc_run = tl.zeros([BLOCK_M, BLOCK_D], COMPUTE)
    for c in range(split, tl.cdiv(kv_end, KV_CHUNK), num_splits):
        # Each chunk starts a fresh online softmax: its state depends on its keys only.
        m_i = tl.full([BLOCK_M], float("-inf"), COMPUTE)
        l_i = tl.zeros([BLOCK_M], COMPUTE)
        acc = tl.zeros([BLOCK_M, BLOCK_D], COMPUTE)
        chunk_stop = tl.minimum((c + 1) * KV_CHUNK, kv_end)
        for start in range(c * KV_CHUNK, chunk_stop, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_valid = n < chunk_stop
            # Only the table entries of positions < seq_len are read (ATTN-BOUNDS-1);
            # 64-bit because slot · row size passes 2^31 in a large cache.
            block = tl.load(table_row + n // block_size, mask=n_valid, other=0).to(tl.int64)
            kv_valid = n_valid & (block >= 0) & (block < num_blocks)  # a bad id: not read
            row_offset = (block * block_size + n % block_size) * cache_stride_slot + head_offset
            k = tl.load(  # [BLOCK_D, BLOCK_N]: K transposed
                k_cache_ptr + row_offset[None, :] + d[:, None],
                mask=d_valid[:, None] & kv_valid[None, :],
                other=0.0,
            )
            v = tl.load(
                v_cache_ptr + row_offset[:, None] + d[None, :],
                mask=kv_valid[:, None] & d_valid[None, :],
                other=0.0,
            )
            if UPCAST:
                k = k.to(COMPUTE)
                v = v.to(COMPUTE)
            if FMA_DOT:  # float64: products and sums on the FMA units
                scores = tl.sum(q[:, :, None] * k[None, :, :], axis=1)
            else:
                scores = tl.dot(q, k, input_precision="ieee")
            visible = (n[None, :] <= position[:, None]) & n_valid[None, :]
            scores = tl.where(visible, scores * qk_scale, float("-inf"))

            # Online softmax: rescale what came before to the new running maximum. A row
            # that has seen nothing yet keeps maximum −inf; shift by 0 so exp gives 0,
            # not NaN. A step past a row's limit leaves its state unchanged (alpha = 1).
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            if EXP2:
                alpha = tl.exp2(m_i - m_shift)
                p = tl.exp2(scores - m_shift[:, None])
            else:
                alpha = tl.exp(m_i - m_shift)
                p = tl.exp(scores - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if FMA_DOT:
                weighted = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            else:
                weighted = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            acc = acc * alpha[:, None] + weighted
            m_i = m_new
        if SPLIT:  # the chunk's own state, for the tile's last program to fold
            chunk = tl.cast(c, tl.int64) * chunk_stride + out_row
            tl.store(chunk_m_ptr + chunk, m_i, mask=row_valid)
            tl.store(chunk_l_ptr + chunk, l_i, mask=row_valid)
            tl.store(
                chunk_acc_ptr + chunk[:, None] * head_dim + d[None, :],
                acc,
                mask=row_valid[:, None] & d_valid[None, :],
            )
        else:
            m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_i, l_i, acc, EXP2)

    last = True
    if SPLIT:
        # The tile's programs count themselves in (kernels/workspace.py): the last folds
        # every chunk in order, as the unsplit path does, so the bits do not depend on
        # the split count; chunks past a row's limit are empty and change no bit.
        tl.debug_barrier()  # every thread's chunk stores before the count releases them
        counter = counters_ptr + counter_base + tile * tl.num_programs(1) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        last = arrived == num_splits - 1
        if last:
            for c in range(0, tl.cdiv(kv_end, KV_CHUNK)):
                chunk = tl.cast(c, tl.int64) * chunk_stride + out_row
                # .cg: from L2, where the other programs' stores are, not a stale L1
                m_c = tl.load(
                    chunk_m_ptr + chunk, mask=row_valid, other=float("-inf"), cache_modifier=".cg"
                )
                l_c = tl.load(chunk_l_ptr + chunk, mask=row_valid, other=0.0, cache_modifier=".cg")
                acc_c = tl.load(
                    chunk_acc_ptr + chunk[:, None] * head_dim + d[None, :],
                    mask=row_valid[:, None] & d_valid[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                m_run, l_run, acc_run = _fold(m_run, l_run, acc_run, m_c, l_c, acc_c, EXP2)
            tl.atomic_xchg(counter, 0)  # zero for the next call
    if last:
        out, lse = _finish(m_run, l_run, acc_run, EXP2)
        tl.store(
            out_ptr + out_row[:, None] * head_dim + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
        if STORE_LSE:
            tl.store(lse_ptr + out_row, lse.to(lse_ptr.dtype.element_ty), mask=row_valid)


# ---------------------------------------------------------------- launch configuration


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs one program at a time
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile_shape(rows: int, group: int, head_dim: int, fp64: bool) -> dict:
    """Block sizes of tiles of about `rows` matrix rows: `rows // group` query rows."""
    block_q = max(1, rows // group)
    block_d = max(16, triton.next_power_of_2(head_dim))
    if fp64:  # the FMA path holds a [BLOCK_M, BLOCK_D, BLOCK_N] product
        block_n = 16
    elif INTERPRET:  # fewer, larger steps: the interpreter's cost is per step
        block_n = 64
    else:
        block_n = 64 if block_d <= 128 else 32
    assert KV_CHUNK % block_n == 0  # a chunk is walked in whole steps
    return {
        "BLOCK_Q": block_q,
        "BLOCK_M": max(16, triton.next_power_of_2(block_q * group)),
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
    }


def _launches(num_tokens: int, batch: int, group: int, head_dim: int, fp64: bool, longest=None):
    """The attention kernel's launches, (block sizes, tiles, ONE_TILE, short_q_len) each:
    16-row tiles for sequences of q_len <= short_q_len, one each; 64-row tiles (16 for
    float64) for the others, numbered per sequence (module docstring). The second only
    when a sequence may be longer than a short tile (its q_len bound `longest`, the
    caller's max_query_len, else num_tokens): a decode batch gets one launch."""
    short = _tile_shape(16, group, head_dim, fp64)
    launches = [(short, batch, True, 0)]
    if (
        min(num_tokens, num_tokens if longest is None else longest) > short["BLOCK_Q"]
    ):  # some sequence may be longer
        long = _tile_shape(16 if fp64 else 64, group, head_dim, fp64)
        launches.append((long, num_tokens // long["BLOCK_Q"] + batch, False, short["BLOCK_Q"]))
    return launches


def choose_num_splits(
    num_tiles: int, num_kv_heads: int, capacity: int, device: torch.device
) -> int:
    """How many programs share each tile's chunks of positions (split-KV): speed only.

    The split count never changes a bit of the result (the module docstring's
    Split-KV section): this heuristic is free to choose from the batch.

    Args:
        num_tiles: programs per KV head and split (query tiles).
        num_kv_heads: KV heads.
        capacity: positions a sequence can hold, `max_blocks_per_seq · block_size`
            (an upper bound of every `seq_lens[b]`, known without a device read).
        device: where the kernel runs.

    Returns:
        1 when the tiles alone give the GPU about four programs per
        multiprocessor or the sequences are short; otherwise enough splits to
        get there, at most one per KV_CHUNK chunk of the capacity and at most
        MAX_SPLITS.
    """
    programs = num_tiles * num_kv_heads
    target = 4 * _multiprocessor_count(device)
    if programs >= target:
        return 1
    return max(1, min(-(-target // programs), -(-capacity // KV_CHUNK), MAX_SPLITS))


def default_num_splits(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    max_seq_len: int | None = None,
) -> int:
    """The split count `paged_attention` uses for these arguments when `num_splits` is None
    (a matter of speed: any count gives the same bits)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    group, fp64 = num_q_heads // num_kv_heads, q.dtype == torch.float64
    long = _launches(num_tokens, batch, group, head_dim, fp64)[-1][0]
    # Query tiles: at least as many as have work, in all launches together.
    num_tiles = num_tokens // long["BLOCK_Q"] + batch
    capacity = _seq_len_limit(block_table.shape[1] * block_size, max_seq_len)
    return choose_num_splits(num_tiles, num_kv_heads, capacity, q.device)


def _seq_len_limit(capacity: int, max_seq_len: int | None) -> int:
    """The largest seq_len the call allows: the table's capacity, or max_seq_len below it."""
    return capacity if max_seq_len is None else min(capacity, max_seq_len)


# ---------------------------------------------------------------- validation


def _check(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    scale: float | None,
    num_splits: int | None,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> None:
    """ATTN-VALID-1's host part, plus `num_splits` and the metadata: shapes, dtypes,
    devices and Python numbers, before any launch; reads nothing from the device."""
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
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    num_tokens, num_q_heads, head_dim = q.shape
    if num_q_heads < 1 or head_dim < 1:
        raise ValueError(f"q must have num_q_heads and head_dim >= 1, got {list(q.shape)}")
    check_kernel_device("q", q)
    if k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache must have q's dtype {q.dtype}, got {k_cache.dtype}")
    if k_cache.device != q.device:
        raise ValueError(f"k_cache is on {k_cache.device}, q on {q.device}")
    _, _, num_kv_heads, kv_head_dim = check_caches(k_cache, v_cache)
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
            "block_table must have shape [batch, max_blocks_per_seq], "
            f"got {list(block_table.shape)}"
        )
    max_blocks = block_table.shape[1]
    check_index_tensor("block_table", block_table, [batch, max_blocks], q.device)
    if scale is not None and not (
        isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale)
    ):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if num_splits is not None and not (
        isinstance(num_splits, int)
        and not isinstance(num_splits, bool)
        and 1 <= num_splits <= MAX_FORCED_SPLITS
    ):
        raise ValueError(
            f"num_splits must be None or an int in [1, {MAX_FORCED_SPLITS}], got {num_splits!r}"
        )
    for name, bound in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if bound is not None and not (
            isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0
        ):
            raise ValueError(f"{name} must be None or an int >= 0, got {bound!r}")
    if batch == 0 and num_tokens != 0:
        raise ValueError(f"query_start must end at num_tokens={num_tokens}: no sequence, no row")


def _explain(
    q: Tensor,
    k_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start: Tensor,
    max_query_len: int | None,
    max_seq_len: int | None,
) -> None:
    """ATTN-VALID-1's value part: raise the error the kernel's words report, naming the
    argument, row and value (reads the device: the failing path only)."""
    num_tokens = q.shape[0]
    num_blocks, block_size = k_cache.shape[:2]
    batch, max_blocks = block_table.shape
    lens = seq_lens.tolist()
    starts = query_start.tolist()
    capacity = max_blocks * block_size
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity:
            raise ValueError(
                f"seq_lens[{b}] = {n} must be in [0, {capacity}] "
                f"(max_blocks_per_seq {max_blocks} × block_size {block_size})"
            )
        if max_seq_len is not None and n > max_seq_len:
            raise ValueError(f"seq_lens[{b}] = {n} is more than max_seq_len = {max_seq_len}")
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
        if max_query_len is not None and q_len > max_query_len:
            raise ValueError(
                f"query_start gives sequence {b} {q_len} query rows, more than "
                f"max_query_len = {max_query_len}"
            )
    # The table entries the kernel reads: the first ceil(seq_len / block_size) of each row.
    read = torch.arange(max_blocks, device=q.device)[None, :] * block_size < seq_lens[:, None]
    bad = read & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise ValueError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} must be in [0, {num_blocks}) "
            f"(sequence {b} has {lens[b]} positions in blocks of {block_size})"
        )


# ---------------------------------------------------------------- the operation


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
    num_splits: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    errors: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Causal attention of packed queries over a paged KV cache (spec.attention.paged_attention).

    Args:
        q: `[num_tokens, num_q_heads, head_dim]`, float16, bfloat16, float32 or
            float64 (the last dimension contiguous or not): every sequence's
            new tokens' queries, packed.
        k_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, q's dtype,
            contiguous; any block size from 1, any head dim (padded to a power
            of two inside the kernel).
        v_cache: same shape and dtype as `k_cache`.
        block_table: `[batch, max_blocks_per_seq]` int32/int64; entry (b, i) is
            the block holding positions `i·block_size ...` of sequence b. Only
            the entries of positions below `seq_lens[b]` are read.
        seq_lens: `[batch]` int32/int64, each sequence's length including its
            new tokens (0 for a sequence without keys: its rows give zeros).
        query_start: `[batch + 1]` int32/int64, offsets of each sequence's rows
            in `q`; its rows are its last `q_len` positions (causal, bottom-right).
        scale: multiplies the dot products; `1 / sqrt(head_dim)` if None.
        return_lse: also return each row's log-sum-exp of scaled scores.
        validate: check shapes, dtypes and devices on the host (ATTN-VALID-1),
            and, when `errors` is None, read the kernel's error words once and
            raise. False skips both: a wrong shape is then undefined behaviour
            (bad index values never are: the kernel masks them).
        num_splits: programs sharing each tile's KV chunks (split-KV); None
            lets `choose_num_splits` decide. A matter of speed only: every
            count gives the same bits, and so does every batch a sequence is
            in (issue 40; the module docstring's Split-KV section).
        max_query_len: a bound on every sequence's q_len that the engine knows
            on the host (vLLM's and FlashInfer's plan metadata). At most one
            short tile's rows (a decode or short verify batch): one launch, not
            two. A sequence over it gets no output and `ERROR_QUERY_LEN_TOO_LONG`.
        max_seq_len: a bound on every `seq_lens[b]`, below the table's capacity:
            smaller split-KV buffers and split counts. One over it reads only
            its first max_seq_len positions and gets `ERROR_SEQ_LEN_OUT_OF_RANGE`.
        errors: `[batch]` int32, contiguous, on q's device, or None. Given, the
            kernel writes each sequence's error word there (0, or ERROR_* bits:
            a block id, seq_len or query_start out of range, which the kernel
            masked, never followed: the sequence's rows are then unspecified)
            and the wrapper reads nothing: the caller reads the words when it
            chooses.

    Returns:
        `out`, `[num_tokens, num_q_heads, head_dim]` in q's dtype; with
        `return_lse`, `(out, lse)`, lse `[num_tokens, num_q_heads]` float32
        (float64 for float64 inputs).

    Raises:
        ValueError: a wrong shape, dtype, device (nothing launched) or, when
            `errors` is None, index or value (after the launch, which masked
            it); the message names the argument.
        TypeError: an argument that must be a tensor is not; the message names
            it. Nothing is launched.

    Cost (tests/kernels/test_contracts_attention.py), with `errors` given: 0 host
    syncs; launches: 1 attention launch when `max_query_len` fits a short tile
    (decode), else 2 (short and long tiles), split or not (the tile's last program
    merges the splits); small torch ops: at most 1 (q · scale in float64, or a copy of a q whose
    head_dim is strided). With `errors` None and `validate`: 1 sync after the
    launches (`raise_for_errors`) and 2 more small ops (zeroing and reducing the words).

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
    limits = (max_query_len, max_seq_len)
    if validate:
        _check(q, k_cache, v_cache, block_table, seq_lens, query_start, scale, num_splits, *limits)
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    words = error_words(errors, batch, q.device)
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    fp64 = q.dtype == torch.float64
    compute = torch.float64 if fp64 else torch.float32
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_tokens, num_q_heads, dtype=compute, device=q.device)
    if batch == 0:  # then no row either (_check): nothing to launch, no word to write
        return (out, lse) if return_lse else out

    if fp64:
        # Triton passes Python floats as float32: scale in float64 here, not in the kernel.
        q, qk_scale = q * scale, 1.0
    else:
        q, qk_scale = (q if q.stride(-1) == 1 else q.contiguous()), scale * LOG2E
    launches = _launches(num_tokens, batch, group, head_dim, fp64, max_query_len)
    if num_splits is None:
        num_splits = default_num_splits(q, k_cache, block_table, seq_lens, max_seq_len)
    split = num_splits > 1 and num_tokens > 0
    # Split: each chunk's state, for every chunk the table could hold (no device read).
    seq_len_limit = _seq_len_limit(block_table.shape[1] * block_size, max_seq_len)
    num_chunks = -(-seq_len_limit // KV_CHUNK) if split else 0
    chunk_m = torch.empty(num_chunks, num_tokens, num_q_heads, dtype=compute, device=q.device)
    chunk_l = torch.empty_like(chunk_m)
    chunk_acc = torch.empty(*chunk_m.shape, head_dim, dtype=compute, device=q.device)
    chunk_stride = num_tokens * num_q_heads
    programs = [num_tiles * num_kv_heads for _, num_tiles, _, _ in launches]
    counters = arrival_counters(q.device, sum(programs)) if split else words
    COMPUTE = tl.float64 if fp64 else tl.float32
    # No FMA contraction: `L·a + l·b` must round the same on both paths (_fold).
    for (tiles, num_tiles, one_tile, short_q_len), counter_base in zip(
        launches, (0, programs[0]), strict=False
    ):
        _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
            q,
            k_cache,
            v_cache,
            block_table,
            seq_lens,
            query_start,
            out,
            lse,
            chunk_m,
            chunk_l,
            chunk_acc,
            counters,
            words,
            qk_scale,
            batch,
            num_tokens,
            num_blocks,
            seq_len_limit,
            num_tokens if max_query_len is None else max_query_len,
            block_size,
            num_q_heads,
            head_dim,
            num_splits,
            short_q_len,
            q.stride(0),
            q.stride(1),
            num_kv_heads * head_dim,
            block_table.stride(0),
            chunk_stride,
            counter_base,
            GROUP=group,
            KV_CHUNK=KV_CHUNK,
            COMPUTE=COMPUTE,
            EXP2=not fp64,
            FMA_DOT=fp64,
            # The interpreter computes float16/bfloat16 arithmetic and dots wrongly.
            UPCAST=INTERPRET and q.dtype in (torch.float16, torch.bfloat16),
            ONE_TILE=one_tile,
            SPLIT=split,
            STORE_LSE=return_lse,
            # Past a 16 × 64 tile, 4 warps need all 255 registers and still spill on
            # sm_90; 8 do not (ptxas -v, tests/kernels/compile_for_gpu.py).
            num_warps=4 if tiles["BLOCK_M"] * tiles["BLOCK_D"] <= 1024 else 8,
            num_stages=2,
            enable_fp_fusion=False,
            **tiles,
        )
    if validate and errors is None:  # the one sync: read the words, explain a bad one
        explain = (q, k_cache, block_table, seq_lens, query_start, *limits)
        raise_for_errors(words, lambda: _explain(*explain))
    return (out, lse) if return_lse else out
