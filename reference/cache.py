"""The paged KV cache and its block allocator.

The cache of each layer is one tensor of fixed-size blocks,
`[num_blocks, block_size, num_kv_heads, head_dim]` (SEMANTICS.md, "Attention
with a KV cache"). A sequence owns a list of blocks, so sequences of any
length share one pool without fragmentation, and a finished sequence's blocks
go straight back to the pool for the next request.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from decodespec.spec.forward import ModelConfig, PagedBatch


class CacheFullError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class BlockAllocator:
    """A free list of block indices.

    Example:
        >>> pool = BlockAllocator(4)
        >>> blocks = pool.allocate(3)
        >>> pool.num_free
        1
        >>> pool.free(blocks); pool.num_free
        4
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # Reused blocks come back first: a block a request just freed is still warm.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks; raise CacheFullError (taking none) if there are fewer."""
        if count > len(self._free):
            raise CacheFullError(
                f"the KV cache needs {count} more blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free"
            )
        taken = [self._free.pop() for _ in range(count)]
        return taken

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool."""
        if any(not 0 <= b < self.num_blocks for b in blocks) or len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free blocks {blocks}: out of range or repeated")
        free = set(self._free)
        if free.intersection(blocks):
            raise ValueError(f"blocks {sorted(free.intersection(blocks))} are already free")
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Per-layer K and V block pools and the allocator that hands out their blocks."""

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
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

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
