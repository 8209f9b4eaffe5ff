"""The block manager's own contract, on requests alone (no model): a request's block
table grows and shrinks by whole blocks, a prefix another request registered is
mapped (never the last token's block, whose positions before it are copied), and
every block comes back."""

from __future__ import annotations

import pytest

from decodespec.reference.block_manager import BlockManager, CacheCapacityError
from tests.engine.test_scheduler import request

SIZE = 4


def free_blocks(manager: BlockManager) -> int:
    return sum(1 for count in manager.allocator.ref_counts if count == 0)


def test_a_request_the_cache_could_never_hold_is_refused_naming_max_tokens():
    manager = BlockManager(num_blocks=2, block_size=SIZE)
    with pytest.raises(CacheCapacityError, match="needs 3 cache blocks of 4 positions"):
        manager.check_fits(request(0, 6), max_tokens=4, limit="max_tokens")
    manager.check_fits(request(1, 6), max_tokens=3, limit="max_tokens")  # 8 positions


def test_blocks_grow_and_shrink_by_whole_blocks_and_all_come_back():
    manager = BlockManager(num_blocks=4, block_size=SIZE)
    r = request(0, 5)
    assert manager.allocate(r) and len(r.blocks) == 2 and r.num_cached == 0
    assert manager.grow(r, 12) and len(r.blocks) == 3
    assert not manager.grow(r, 20) and len(r.blocks) == 3  # 5 blocks: none taken
    manager.shrink(r, 5)
    assert len(r.blocks) == 2
    manager.free(r)
    assert r.blocks == [] and free_blocks(manager) == 4


def test_a_registered_prefix_is_mapped_but_never_the_last_tokens_block():
    manager = BlockManager(num_blocks=8, block_size=SIZE, prefix_caching=True)
    first = request(0, 9)  # prompt 1..9: two full blocks, then one position
    assert manager.allocate(first)
    manager.register_full_blocks(first, written=9)
    assert len(first.prefix_keys) == 2
    same = request(1, 9)
    assert manager.allocate(same)
    assert same.blocks[:2] == first.blocks[:2] and same.num_cached == 8
    exact = request(2, 8)  # its last token ends the second block: that block is its own
    assert manager.allocate(exact)
    assert exact.blocks[0] == first.blocks[0] and exact.blocks[1] != first.blocks[1]
    # ... and holds a copy of the 3 positions before the last token, held until made.
    assert exact.num_cached == 7 and exact.prefix_copy == (first.blocks[1], exact.blocks[1], 3)
    assert manager.allocator.ref_counts[first.blocks[1]] == 3  # first, same and the copy
    manager.copied(exact)
    assert exact.prefix_copy is None and manager.allocator.ref_counts[first.blocks[1]] == 2
    later = request(3, 8)
    assert manager.allocate(later) and later.prefix_copy is not None
    for r in (first, same, exact, later):  # `free` lets an unmade copy's source go too
        manager.free(r)
    assert free_blocks(manager) == 8  # registered blocks stay cached, but free to reuse
