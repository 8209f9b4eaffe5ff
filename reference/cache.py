"""The paged KV cache: per-layer block pools, and packing a pass's tokens into them.

The cache of each layer is one tensor of fixed-size blocks,
`[num_blocks, block_size, num_kv_heads, head_dim]` (SEMANTICS.md, "Attention
with a KV cache"). A sequence maps a list of blocks (its block table), so
sequences of any length share one pool without fragmentation; which block is
whose, and which finished blocks are kept for reuse, is the block manager's
business (`block_manager.py`): this module only keeps the tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from decodespec.spec.forward import ModelConfig, PagedBatch


class PagedKVCache:
    """Per-layer K and V pools of `num_blocks` blocks of `block_size` positions."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Uninitialised: no slot is read before it is written (ATTN-BOUNDS-1), and
        # untouched pages of a large cache cost no memory until a sequence reaches them.
        try:
            self.layers: list[tuple[Tensor, Tensor]] = [
                (
                    torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(shape, dtype=dtype, device=device),
                )
                for _ in range(config.num_layers)
            ]
        except (RuntimeError, MemoryError) as error:
            size = 2 * config.num_layers * math.prod(shape) * dtype.itemsize
            raise ValueError(
                f"a KV cache of {num_blocks} blocks of {block_size} positions needs "
                f"{size / 2**30:.1f} GiB on {device}, which cannot be allocated: lower "
                f"cache_tokens (or block_size) ({type(error).__name__})"
            ) from error

    def copy_positions(self, source: int, destination: int, count: int) -> None:
        """Copy the keys and values of the first `count` positions of block `source` into
        block `destination`, in every layer (a prefix served from part of a cached
        block: `BlockManager.allocate`)."""
        for k_cache, v_cache in self.layers:
            k_cache[destination, :count] = k_cache[source, :count]
            v_cache[destination, :count] = v_cache[source, :count]

    def slots(self, blocks: list[int], start: int, count: int) -> list[int]:
        """Flat slots (block · block_size + offset) of positions start .. start + count − 1."""
        size = self.block_size
        return [blocks[p // size] * size + p % size for p in range(start, start + count)]

    def paged_batch(
        self,
        blocks: Sequence[list[int]],
        starts: Sequence[int],
        new_tokens: Sequence[list[int]],
        num_logits: Sequence[int],
        device: torch.device | str,
    ) -> tuple[Tensor, PagedBatch]:
        """Pack new tokens of several sequences for `decodespec.spec.forward.forward_cached`.

        Sequence b owns `blocks[b]`, has `starts[b]` positions cached, and
        runs `new_tokens[b]` at the positions after them; its last
        `num_logits[b]` tokens are projected to logits.

        Returns:
            `[tokens]` int64 token ids, and where they go (`PagedBatch`).
        """
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        for owned, start, new in zip(blocks, starts, new_tokens, strict=True):
            token_ids += new
            positions += range(start, start + len(new))
            slots += self.slots(owned, start, len(new))
            query_start.append(query_start[-1] + len(new))
        width = max(len(owned) for owned in blocks)
        logits_indices = [
            end - count + i
            for end, count in zip(query_start[1:], num_logits, strict=True)
            for i in range(count)
        ]

        def tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        batch = PagedBatch(
            positions=tensor(positions),
            query_start=tensor(query_start),
            seq_lens=tensor([s + len(n) for s, n in zip(starts, new_tokens, strict=True)]),
            block_table=tensor([owned + [0] * (width - len(owned)) for owned in blocks]),
            slot_mapping=tensor(slots),
            logits_indices=tensor(logits_indices),
        )
        return tensor(token_ids), batch
