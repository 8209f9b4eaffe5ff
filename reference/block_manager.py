"""The block manager: a request's cache blocks, as nano-vllm's block manager.

The scheduler asks in terms of requests — can this one ever fit, admit it
(mapping the cached blocks that hold a prefix of its sequence), grow it to
so many positions, shrink it back after rejected drafts, register its full
blocks for reuse, free it — and never touches blocks itself. Which block is
free, owned or cached is the allocator's business (`block_allocator.py`).

Naive decoding has no cache: `NaiveBlockManager` answers the same questions
with "yes, and no blocks", so the scheduler has one code path for both.
"""

from __future__ import annotations

from .block_allocator import BlockAllocator, BlockHash, CacheFullError, block_hash
from .request import Request


class CacheCapacityError(ValueError):
    """A request the whole cache could never hold (prompt + max_tokens, or the context
    when max_tokens is None): the parameter at fault is max_tokens."""

    param = "max_tokens"


class BlockManager:
    """Blocks of `block_size` positions from a pool of `num_blocks`, per request.

    A request's blocks are `request.blocks` (its block table), its cached
    positions `request.num_cached`, and the keys of its registered leading
    blocks `request.prefix_keys`.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = False,
        hash_fn: BlockHash = block_hash,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, prefix_caching=prefix_caching, hash_fn=hash_fn)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a request admitted maps what earlier ones cached (prefix caching)."""
        return self.allocator.prefix_caching

    def blocks_for(self, positions: int) -> int:
        """How many blocks hold `positions` positions."""
        return -(-positions // self.block_size)

    def check_fits(self, request: Request, max_tokens: int, limit: str) -> None:
        """Raise CacheCapacityError if the request could never fit the whole cache on its own:
        its prompt and `max_tokens` new tokens (bounded by `limit`: "max_tokens" or
        "the context"), the last of which never runs and needs no slot."""
        prompt = len(request.prompt_ids)
        needed = self.blocks_for(prompt + max_tokens - 1)
        if needed > self.num_blocks:
            raise CacheCapacityError(
                f"a {prompt}-token prompt with up to {max_tokens} new tokens ({limit}) needs "
                f"{needed} cache blocks of {self.block_size} positions; the cache has "
                f"{self.num_blocks}: lower max_tokens or raise cache_tokens"
            )

    def allocate(self, request: Request) -> bool:
        """Give an unadmitted request its blocks: the cached ones that hold a prefix of
        its sequence, then new ones for the rest; False, taking none, if they do not
        fit. Where the cache holds the positions after those whole blocks only in part
        (a registered block whose first tokens are the sequence's next ones), the first
        new block is to get a copy of them: `request.prefix_copy` (source block,
        destination block, positions), done by the pass before anything reads it, and
        the source is held until `copied`. `request.num_cached` counts every position
        served, copied ones included."""
        sequence = request.prompt_ids + request.output_ids
        size = self.block_size
        # The last token always runs: its logits choose the next token. So do the
        # positions that score the prompt (prompt_logprobs): the cache has no logits.
        reusable = len(sequence) - 1
        if request.prompt_positions():
            reusable = min(reusable, request.prompt_positions().start)
        hits, keys = self.allocator.match_prefix(sequence, size, reusable // size)
        start = len(hits) * size
        tail = sequence[start : min(start + size, reusable)]
        source, count = self.allocator.match_partial(keys[-1] if keys else None, tail)
        self.allocator.share(hits)  # before allocating, so that no hit is evicted for the rest
        request.blocks = list(hits)
        if count:  # held too while the rest is allocated; if that leaves too few, no copy
            self.allocator.share([source])
            if not self.grow(request, request.length):
                self.allocator.free([source])
                count = 0
        if not count and not self.grow(request, request.length):
            self.free(request)
            return False
        request.prefix_copy = (source, request.blocks[len(hits)], count) if count else None
        request.num_cached = start + count
        request.prefix_keys = keys
        return True

    def copied(self, request: Request) -> None:
        """The pass has made the request's prefix copy: let its source block go."""
        if request.prefix_copy is not None:
            self.allocator.free([request.prefix_copy[0]])
            request.prefix_copy = None

    def grow(self, request: Request, positions: int) -> bool:
        """Give the request blocks for `positions` positions; False, taking none, if the
        pool has too few free."""
        needed = self.blocks_for(positions) - len(request.blocks)
        try:
            request.blocks += self.allocator.allocate(max(0, needed))
        except CacheFullError:
            return False
        return True

    def shrink(self, request: Request, positions: int) -> None:
        """Give back the request's blocks past its first `positions` positions."""
        num_blocks = self.blocks_for(positions)
        if len(request.blocks) > num_blocks:
            self.allocator.free(request.blocks[num_blocks:])
            del request.blocks[num_blocks:]

    def free(self, request: Request) -> None:
        """Give back all of the request's blocks (registered ones stay cached)."""
        self.copied(request)
        if request.blocks:
            self.allocator.free(request.blocks)
        request.blocks = []
        request.prefix_keys = []

    def register_full_blocks(self, request: Request, written: int) -> None:
        """Register the request's full blocks within its first `written` positions (all
        computed from its own tokens) so that later requests can map them."""
        if not self.allocator.prefix_caching:
            return
        size = self.block_size
        sequence = request.prompt_ids + request.output_ids
        for i in range(len(request.prefix_keys), written // size):
            parent = request.prefix_keys[-1] if request.prefix_keys else None
            tokens = sequence[i * size : (i + 1) * size]
            request.prefix_keys.append(self.allocator.register(request.blocks[i], parent, tokens))


class NaiveBlockManager:
    """Naive decoding's twin of `BlockManager`: no cache, so every request fits and
    owns no blocks."""

    reuses_prefixes = False

    def check_fits(self, request: Request, max_tokens: int, limit: str) -> None:
        pass

    def allocate(self, request: Request) -> bool:
        return True

    def grow(self, request: Request, positions: int) -> bool:
        return True

    def shrink(self, request: Request, positions: int) -> None:
        pass

    def copied(self, request: Request) -> None:
        pass

    def free(self, request: Request) -> None:
        pass

    def register_full_blocks(self, request: Request, written: int) -> None:
        pass
