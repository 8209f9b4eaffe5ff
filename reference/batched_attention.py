"""Paged attention batched across sequences, in PyTorch: the engine's `torch` backend.

`decodespec.spec.attention.paged_attention` defines the operation one
sequence at a time. On a CPU that loop is most of a decode step's overhead
once a batch holds more than a few requests: sixteen decoding requests make
sixteen small gathers and matmuls per layer, each costing more in dispatch
than in arithmetic. This module computes the same operation (same signature,
same clauses, same validation) for many sequences at once: sequences with the
same number of query rows (every decoding request has one; every request
verifying k drafts has k + 1) form a group, padded to the group's longest
sequence, and each group is one gather and two batched matmuls. A prompt
chunk usually forms a group of its own.

Padding must not change any result (ATTN-BOUNDS-1): padded key positions
read slot 0 of the cache, which may hold anything, NaN included, so the
gathered keys and values are zeroed there before any arithmetic and the
scores masked to −inf, exactly as a position a causal row does not see.

The conformance suite proves it computes the spec:
`pytest tests/conformance/test_attention.py tests/conformance/test_append_kv.py
--impl decodespec.reference.batched_attention`
(run by `tests/engine/test_batched_attention.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from decodespec.spec import append
from decodespec.spec.attention import check_attention_args
from decodespec.spec.softmax import compute_dtype

# Most score elements (batch × heads × rows × keys) one padded matmul computes at
# once: 2**24 float32 scores are 64 MiB. A group past it is split; a single
# sequence past it (a long prompt) still runs whole, as the spec's loop would.
MAX_SCORES_PER_MATMUL = 1 << 24


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
    """Causal attention of packed queries over a paged KV cache, batched across sequences.

    The operation, arguments, results and errors of
    `decodespec.spec.attention.paged_attention` (ATTN-LAYOUT-1 ... ATTN-VALID-1);
    only the schedule differs, and results agree with the spec's within the
    registry's tolerance, not bitwise.

    Example:
        Two decoding sequences of lengths 2 and 1 in blocks of one slot; zero
        queries average every key they see.

        >>> k_cache = torch.zeros(3, 1, 1, 2)
        >>> v_cache = torch.tensor([1.0, 3.0, 5.0]).view(3, 1, 1, 1).expand(3, 1, 1, 2)
        >>> paged_attention(
        ...     torch.zeros(2, 1, 2), k_cache, v_cache.contiguous(),
        ...     block_table=torch.tensor([[0, 1], [2, -1]]), seq_lens=torch.tensor([2, 1]),
        ...     query_start=torch.tensor([0, 1, 2]))[:, 0]
        tensor([[2., 2.],
                [5., 5.]])
    """
    if validate:
        lens, starts = check_attention_args(
            q, k_cache, v_cache, block_table, seq_lens, query_start, scale
        )
    num_tokens, num_q_heads, head_dim = q.shape
    layout = (block_table, seq_lens, query_start, k_cache.shape[1], num_q_heads, k_cache.shape[2])
    plans = None if validate else _PLANS.get(layout)
    if plans is None:
        if not validate:
            lens, starts = seq_lens.tolist(), query_start.tolist()
        plans = _PLANS.put(layout, _plans(layout, lens, starts, num_tokens))
    acc = compute_dtype(q.dtype)
    attention = _GroupAttention(
        q, k_cache, v_cache, 1.0 / math.sqrt(head_dim) if scale is None else scale
    )
    if len(plans) == 1 and plans[0].every_row and not return_lse:
        return attention(plans[0], False)[0].to(q.dtype)  # one group, rows in order
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=acc, device=q.device)
    lse = torch.full(
        (num_tokens, num_q_heads) if return_lse else (0,), -math.inf, dtype=acc, device=q.device
    )
    for plan in plans:
        group_out, group_lse = attention(plan, return_lse)
        out[plan.rows] = group_out
        if return_lse:
            lse[plan.rows] = group_lse
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


@dataclass
class _Plan:
    """What one padded group gathers: the same for every layer of a forward pass."""

    batch: int
    longest: int
    q_len: int
    rows: Tensor  # [batch · q_len] packed query rows, in the group's order
    every_row: bool  # rows are 0 … num_tokens − 1 in order
    slots: Tensor  # [batch · longest] cache slots of the keys (padding reads slot 0)
    is_key: Tensor | None  # [batch, longest], when lengths differ
    visible: Tensor | None  # [batch, 1, group · q_len, longest], where masking is needed


class _PassCache:
    """What was derived from the last batch layout. A forward pass validates at its
    first layer, which derives it, and not at the others, which reuse it while they
    are called with the same layout (tensors: the very objects, kept alive here so an
    identity match is never a recycled id; numbers: equal)."""

    def __init__(self) -> None:
        self.layout: tuple | None = None
        self.value: object = None

    def get(self, layout: tuple) -> object:
        if self.layout is None or len(layout) != len(self.layout):
            return None
        same = all(
            a is b if isinstance(a, Tensor) else a == b
            for a, b in zip(layout, self.layout, strict=True)
        )
        return self.value if same else None

    def put(self, layout: tuple, value: object) -> object:
        self.layout, self.value = layout, value
        return value


def _plans(layout: tuple, lens: list[int], starts: list[int], num_tokens: int) -> list[_Plan]:
    """The plan of every padded group of a batch (`paged_attention`'s layout tuple)."""
    block_table, _, _, block_size, num_q_heads, kv_heads = layout
    plans = [
        _plan(block_table, block_size, num_q_heads // kv_heads, chunk, lens, starts, q_len)
        for q_len, sequences in _groups(lens, starts)
        for chunk in _chunks(sequences, lens, q_len * num_q_heads)
    ]
    for plan in plans:
        plan.every_row = plan.rows.numel() == num_tokens and bool(
            (plan.rows == torch.arange(num_tokens, device=plan.rows.device)).all()
        )
    return plans


_PLANS = _PassCache()  # paged_attention's plans
_SLOTS = _PassCache()  # append_kv's (kept mask or None when every token is kept, slots)


def _plan(
    block_table: Tensor,
    block_size: int,
    group: int,
    sequences: list[int],
    lens: list[int],
    starts: list[int],
    q_len: int,
) -> _Plan:
    device = block_table.device
    seq_lens = torch.tensor([lens[b] for b in sequences], device=device)
    batch, longest = len(sequences), int(seq_lens.max())
    padded = int(seq_lens.min()) < longest  # padding needs the masks below
    position = torch.arange(longest, device=device)
    blocks = block_table[sequences][:, position // block_size].to(torch.int64)
    is_key = None
    if padded:  # the table entries past a sequence may hold anything (ATTN-BOUNDS-1)
        is_key = position[None, :] < seq_lens[:, None]  # [batch, longest]
        blocks = blocks.masked_fill(~is_key, 0)
    slots = (blocks * block_size + position % block_size).flatten()
    rows = (
        torch.tensor([starts[b] for b in sequences], device=device)[:, None]
        + torch.arange(q_len, device=device)
    ).flatten()
    visible = None
    if q_len > 1 or padded:  # a lone row of an unpadded sequence sees every key
        # ATTN-CAUSAL-1: row r sits at seq_len − q_len + r; padded keys lie past every row.
        row_position = seq_lens[:, None] - q_len + torch.arange(q_len, device=device)
        seen = position[None, None, :] <= row_position[:, :, None]  # [batch, q_len, longest]
        seen = seen[:, None].expand(batch, group, q_len, longest)
        visible = seen.reshape(batch, 1, group * q_len, longest)
    return _Plan(batch, longest, q_len, rows, False, slots, is_key, visible)


def append_kv(
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    validate: bool = True,
) -> None:
    """`decodespec.spec.append.append_kv` (same signature, clauses and errors), with
    the kept slots of a pass found once: at the call that validates (a forward
    pass's first layer), reused by the unvalidated calls with the same
    `slot_mapping` object (the later layers), as the attention's plans are.
    """
    if validate:
        append.check_append_args(key, value, k_cache, v_cache, slot_mapping)  # the spec's own
    found = None if validate else _SLOTS.get((slot_mapping,))
    if found is None:
        kept = slot_mapping >= 0  # APPEND-SKIP-1
        every = bool(kept.all())
        found = _SLOTS.put((slot_mapping,), (None if every else kept, slot_mapping[kept].long()))
    kept, slots = found
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for cache, rows in ((k_cache, key), (v_cache, value)):  # APPEND-SLOT-1
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        flat.index_copy_(0, slots, (rows if kept is None else rows[kept]).to(cache.dtype))


def _groups(lens: list[int], starts: list[int]) -> list[tuple[int, list[int]]]:
    """Sequences with rows and keys, by their number of query rows (ATTN-EMPTY-1:
    the others keep zeros and −inf)."""
    groups: dict[int, list[int]] = {}
    for b, seq_len in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len > 0 and seq_len > 0:
            groups.setdefault(q_len, []).append(b)
    return list(groups.items())


def _chunks(sequences: list[int], lens: list[int], scores_per_key: int) -> list[list[int]]:
    """`sequences` in runs whose padded scores stay within MAX_SCORES_PER_MATMUL."""
    chunks: list[list[int]] = [[]]
    longest = 0
    for b in sequences:
        longest_with_b = max(longest, lens[b])
        if chunks[-1] and (len(chunks[-1]) + 1) * scores_per_key * longest_with_b > (
            MAX_SCORES_PER_MATMUL
        ):
            chunks.append([])
            longest_with_b = lens[b]
        chunks[-1].append(b)
        longest = longest_with_b
    return chunks


class _GroupAttention:
    """Attention of the groups of a plan: same number of query rows, padded to the longest."""

    def __init__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, scale: float) -> None:
        num_blocks, block_size, self.num_kv_heads, head_dim = k_cache.shape
        self.q = q
        self.flat_k = k_cache.view(num_blocks * block_size, self.num_kv_heads, head_dim)
        self.flat_v = v_cache.view(num_blocks * block_size, self.num_kv_heads, head_dim)
        self.scale = scale
        self.acc = compute_dtype(q.dtype)

    def __call__(self, plan: _Plan, with_lse: bool) -> tuple[Tensor, Tensor | None]:
        """`(out, lse)` of the plan's rows (lse None unless `with_lse`)."""
        batch, longest, q_len = plan.batch, plan.longest, plan.q_len
        _, num_q_heads, head_dim = self.q.shape
        kv_heads, group = self.num_kv_heads, num_q_heads // self.num_kv_heads

        # Keys and values [batch, kv_heads, longest, head_dim]; padding reads slot 0 and is zeroed.
        keys, values = (
            cache.index_select(0, plan.slots).view(batch, longest, kv_heads, head_dim).to(self.acc)
            for cache in (self.flat_k, self.flat_v)
        )
        if plan.is_key is not None:  # NaN · 0 is NaN: a padded value must be 0, not unweighted
            keys, values = (
                t.masked_fill(~plan.is_key[:, :, None, None], 0) for t in (keys, values)
            )
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)

        # Queries [batch, kv_heads, group · q_len, head_dim]; query head h = kv · group + g.
        queries = (self.q if plan.every_row else self.q.index_select(0, plan.rows)).to(self.acc)
        queries = queries.view(batch, q_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        queries = queries.reshape(batch, kv_heads, group * q_len, head_dim)

        scores = self.scale * (queries @ keys.transpose(2, 3))
        if plan.visible is not None:
            scores = scores.masked_fill(~plan.visible, -math.inf)

        out = scores.softmax(dim=-1) @ values  # every row sees position 0: no empty softmax
        out = out.view(batch, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(batch * q_len, num_q_heads, head_dim)
        if not with_lse:
            return out, None
        lse = torch.logsumexp(scores, dim=-1).view(batch, kv_heads, group, q_len)  # ATTN-LSE-1
        return out, lse.permute(0, 3, 1, 2).reshape(batch * q_len, num_q_heads)
