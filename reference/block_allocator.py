"""Cache blocks: who owns them, and which hold a prefix another request can reuse.

A block is free, owned (reference count >= 1: mapped by that many requests'
block tables), or *cached*: no request owns it, but it holds the keys and
values of a full block of some sequence, so that a later request whose
tokens start the same way maps it instead of computing it again (prefix
caching, as vLLM's automatic prefix caching). Cached blocks stay until the
allocator needs room; then the least recently used goes first.

A full block is identified by its tokens and by everything before it: its
key is `block_hash(parent_key, tokens)`, SHA-256 of the parent's key and the
block's token ids (LOOP-PREFIX-1 in `decodespec.spec.generate`). Two
different prefixes share a key only on a SHA-256 collision (odds below
2**-128 even among 2**64 blocks), and even then nothing wrong is reused: the
table keeps every block under its key, and a lookup checks the block's own
tokens and the identity of its parent block, so a collision costs a
comparison, never a wrong block (tested with a hash that always collides).

Only full blocks are shared, and only blocks whose every position has been
written: nobody writes to a shared block, so copy-on-write is never needed.
A request's last, partial block is always its own. What a registered block
holds can still serve a sequence that shares only its first tokens:
`match_partial` finds the registered block after a given prefix whose
tokens begin the longest way like the sequence's next ones, and the request
copies those positions into a block of its own (`BlockManager.allocate`),
so a prompt shorter than a block, or one that leaves a block part way, is
served from the cache as well (llama.cpp's and SGLang's token-granular
reuse, on vLLM's block table).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# block_hash(parent_key, tokens) -> key; the first block's parent key is ROOT_KEY.
BlockHash = Callable[[bytes, Sequence[int]], bytes]
ROOT_KEY = b""


def block_hash(parent_key: bytes, tokens: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's key and the block's token ids (int64, little-endian).

    Example:
        >>> first = block_hash(ROOT_KEY, [1, 2, 3, 4])
        >>> block_hash(first, [5, 6, 7, 8]) != block_hash(ROOT_KEY, [5, 6, 7, 8])
        True
    """
    digest = hashlib.sha256(parent_key)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
    return digest.digest()


class CacheFullError(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


@dataclass(frozen=True)
class PrefixKey:
    """Where a request's full block sits in the prefix table: its hash key, and the
    serial number of the registration that holds its contents (unique for the
    allocator's lifetime, so that a block reused for other tokens is never
    mistaken for the old one)."""

    key: bytes
    serial: int


@dataclass(frozen=True)
class _Entry:
    key: bytes
    tokens: tuple[int, ...]
    parent_serial: int  # 0: the first block of a sequence
    serial: int


class BlockAllocator:
    """Reference-counted blocks with an optional prefix cache.

    `allocate` hands out blocks (free ones first, then the least recently
    used cached ones, which leave the prefix table); `free` drops one
    reference per block, and a block nobody owns goes back to the free list,
    or, if it holds a registered prefix, to the cached list. With
    `prefix_caching=False` nothing is ever registered and this is a plain
    free list.

    Example:
        >>> pool = BlockAllocator(4)
        >>> blocks = pool.allocate(3)
        >>> pool.num_free
        1
        >>> pool.free(blocks); pool.num_free
        4
    """

    def __init__(
        self, num_blocks: int, *, prefix_caching: bool = False, hash_fn: BlockHash = block_hash
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.hash_fn = hash_fn
        self.ref_counts = [0] * num_blocks
        # Reused blocks come back first: a block a request just freed is still warm.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unowned, LRU first
        self._entries: dict[int, _Entry] = {}  # block -> what it holds
        self._table: dict[bytes, list[int]] = {}  # key -> blocks registered under it
        # (parent serial, first token) -> registered blocks: `match_partial`'s candidates.
        self._children: dict[tuple[int, int], list[int]] = {}
        self._serials = itertools.count(1)
        self.evictions = 0  # cached blocks taken back for other contents

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free and cached."""
        return len(self._free) + len(self._cached)

    @property
    def free_blocks(self) -> frozenset[int]:
        """Blocks nobody owns that hold no prefix."""
        return frozenset(self._free)

    @property
    def cached_blocks(self) -> frozenset[int]:
        """Blocks nobody owns that still hold a reusable prefix (evicted LRU first)."""
        return frozenset(self._cached)

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks, each with one reference; raise CacheFullError (taking
        none) if fewer than `count` are free or cached."""
        if count > self.num_free:
            raise CacheFullError(
                f"the KV cache needs {count} more blocks but only {self.num_free} of "
                f"{self.num_blocks} are free"
            )
        taken = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently used cached prefix block
                block, _ = self._cached.popitem(last=False)
                self._forget(block)
                self.evictions += 1
            self.ref_counts[block] = 1
            taken.append(block)
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A block left unowned is cached if it holds
        a registered prefix, else free. Pass a request's blocks in table order: the
        last ones become the least recently used, since a sequence's later blocks
        are the least likely to be shared."""
        if any(not 0 <= b < self.num_blocks for b in blocks) or len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free blocks {list(blocks)}: out of range or repeated")
        unowned = [b for b in blocks if self.ref_counts[b] == 0]
        if unowned:
            raise ValueError(f"blocks {sorted(unowned)} are already free")
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self._entries:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def share(self, blocks: Sequence[int]) -> None:
        """Take one more reference to each of `blocks` (from `match_prefix`)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                if block not in self._cached:
                    raise ValueError(f"block {block} is free: it holds no prefix to share")
                del self._cached[block]
            self.ref_counts[block] += 1

    # -- the prefix table

    def match_prefix(
        self, token_ids: Sequence[int], block_size: int, max_blocks: int
    ) -> tuple[list[int], list[PrefixKey]]:
        """The registered blocks holding the longest prefix of `token_ids` in whole
        blocks (at most `max_blocks`), and their keys. Takes no reference: `share`
        them before anything else is allocated."""
        blocks: list[int] = []
        keys: list[PrefixKey] = []
        if not self.prefix_caching:
            return blocks, keys
        parent = PrefixKey(ROOT_KEY, 0)
        for i in range(min(max_blocks, len(token_ids) // block_size)):
            tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
            key = self.hash_fn(parent.key, tokens)
            found = self._lookup(key, tokens, parent.serial)
            if found is None:
                break
            parent = PrefixKey(key, self._entries[found].serial)
            blocks.append(found)
            keys.append(parent)
        return blocks, keys

    def register(self, block: int, parent: PrefixKey | None, tokens: Sequence[int]) -> PrefixKey:
        """Record that the owned `block` holds the full block `tokens` after the prefix
        `parent` (None: the first block). Returns the block's key; if an equal block
        is registered already, that one's (this block then stays unregistered)."""
        if not self.prefix_caching:
            raise ValueError("this allocator has prefix caching off")
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not owned: only a written block can be registered")
        parent = parent or PrefixKey(ROOT_KEY, 0)
        tokens = tuple(tokens)
        key = self.hash_fn(parent.key, tokens)
        twin = self._lookup(key, tokens, parent.serial)
        if twin is not None:
            return PrefixKey(key, self._entries[twin].serial)
        if block in self._entries:
            raise ValueError(f"block {block} is registered already")
        entry = _Entry(key, tokens, parent.serial, next(self._serials))
        self._entries[block] = entry
        self._table.setdefault(key, []).append(block)
        self._children.setdefault((parent.serial, tokens[0]), []).append(block)
        return PrefixKey(key, entry.serial)

    def match_partial(self, parent: PrefixKey | None, tokens: Sequence[int]) -> tuple[int, int]:
        """The registered block after the prefix `parent` (None: a sequence's first block)
        whose tokens begin the longest way like `tokens`, and how many of them match:
        `(block, count)`, or `(-1, 0)` if none shares even the first. Takes no
        reference: `share` the block before anything else is allocated."""
        if not self.prefix_caching or not tokens:
            return -1, 0
        parent_serial = parent.serial if parent is not None else 0
        best, best_count = -1, 0
        for block in self._children.get((parent_serial, tokens[0]), ()):
            held = self._entries[block].tokens
            count = 1
            while count < min(len(held), len(tokens)) and held[count] == tokens[count]:
                count += 1
            if count > best_count:
                best, best_count = block, count
        return best, best_count

    def _lookup(self, key: bytes, tokens: tuple[int, ...], parent_serial: int) -> int | None:
        for block in self._table.get(key, ()):
            entry = self._entries[block]
            # The key is only an index: the contents decide (a collision is a miss).
            if entry.tokens == tokens and entry.parent_serial == parent_serial:
                return block
        return None

    def _forget(self, block: int) -> None:
        entry = self._entries.pop(block)
        _unlist(self._table, entry.key, block)
        _unlist(self._children, (entry.parent_serial, entry.tokens[0]), block)


def _unlist(index: dict, name: object, block: int) -> None:
    """Take `block` off `index[name]`, and the name off the index once nothing is left."""
    bucket = index[name]
    bucket.remove(block)
    if not bucket:
        del index[name]
