"""Which of the quantized-linear kernel's paths the conformance shapes reach.

`dequantize_tile` finds a K-tile's scales and offsets in one of three ways
(`_groups_in_tile`): the tile lies inside one group, it holds several whole
groups, or groups straddle the tiles and each element's group is gathered;
the GEMV (decode rows) and the GEMM (`tl.dot`, prefill rows) each run all
three, for 4 and 8 bits. A branch that only ever sees one group a tile cannot
show a wrong group index, so each must be reached with several groups: here
the shapes that tests/conformance/test_quantized_linear.py draws and lists are
put through the wrapper's own choice of kernel and blocks (`_tiling`), so that
the coverage cannot shrink unseen when the blocks or the strategies change.
"""

from __future__ import annotations

import itertools

import torch

from decodespec.kernels import quant_linear
from tests.conformance import test_quantized_linear as conformance

PATHS = ("GEMV", "GEMM")
BRANCHES = ("tile inside a group", "whole groups in a tile", "groups across tiles")
EVERY = {(path, bits, branch) for path in PATHS for bits in (4, 8) for branch in BRANCHES}


def reached(m: int, k: int, group_size: int, bits: int) -> tuple[str, int, str] | None:
    """(kernel, bits, branch) of a float32 call `[m, k]` with groups of `group_size`,
    if it shows a wrong group index: several groups in K, and for the branches that
    compute more than one group a tile, a tile that meets several groups."""
    tiling = quant_linear._tiling(m, k, group_size, fp64=False)
    path = "GEMM" if tiling.gemm else "GEMV"
    if tiling.groups_in_tile == 1:
        several = k >= 2 * group_size
        branch = BRANCHES[0]
    else:
        block = tiling.block_k
        several = any(
            len({i // group_size for i in range(start, min(start + block, k))}) > 1
            for start in range(0, k, block)
        )
        branch = BRANCHES[1] if tiling.groups_in_tile > 1 else BRANCHES[2]
    return (path, bits, branch) if several else None


def strategy_shapes(group_sizes: tuple[int, ...]) -> set[tuple[int, int, int]]:
    """Every `(K, group_size, bits)` `conformance.cases(group_sizes=...)` can draw."""
    shapes = set()
    for bits, size, per_channel in itertools.product((4, 8), group_sizes, (False, True)):
        for groups in range(1, conformance.max_groups(size) + 1):
            shapes.add((*conformance.case_shape(bits, size, groups, per_channel), bits))
    return shapes


def strategy_reaches(group_sizes: tuple[int, ...]) -> set[tuple[str, int, str]]:
    rows = range(1, conformance.MAX_M + 1)
    return {
        where
        for (k, size, bits), m in itertools.product(strategy_shapes(group_sizes), rows)
        if (where := reached(m, k, size, bits))
    }


def test_the_main_strategy_reaches_every_branch_on_both_kernels():
    """`test_matches_the_definition_in_float64` (every dtype) can draw each branch."""
    assert strategy_reaches(conformance.GROUP_SIZES) == EVERY


def test_the_any_size_strategy_straddles_the_tiles_on_both_kernels():
    """`test_groups_of_any_size_that_divides_k`: groups across tiles, several in a tile."""
    want = {where for where in EVERY if where[2] == BRANCHES[2]}
    assert want <= strategy_reaches(conformance.ANY_GROUP_SIZES)


def test_the_listed_shapes_reach_every_branch_on_both_kernels():
    """`test_groups_against_the_k_tiles` runs each branch every time, not by chance:
    among them groups of 96 in K = 192 on a 16-row prefill, groups smaller than the
    tile, groups straddling tiles of 64 and 128, each for 4 and 8 bits."""
    cases = [
        (m, k, size, bits)
        for k, size in conformance.BRANCH_SHAPES
        for m in conformance.BRANCH_ROWS
        for bits in (4, 8)
    ]
    assert {reached(*case) for case in cases} - {None} == EVERY
    assert reached(16, 192, 96, 4) == ("GEMM", 4, BRANCHES[2])


def test_the_listed_shapes_split_k_inside_a_straddling_group():
    """On the interpreter's split-K (the slices' boundaries where a tile's `K` stops),
    some listed shape of each kernel splits K inside a group that crosses tiles."""
    cpu = torch.device("cpu")
    found = set()
    for (k, size), m in itertools.product(conformance.BRANCH_SHAPES, conformance.BRANCH_ROWS):
        tiling = quant_linear._tiling(m, k, size, fp64=False)
        tiles = -(-m // tiling.block_m) * -(-conformance.BRANCH_N // tiling.block_n)
        splits, per_split = quant_linear._splits(tiles, k, tiling.block_k, cpu)
        inside = any((s * per_split) % size for s in range(1, splits))
        if tiling.groups_in_tile == 0 and inside:
            found.add("GEMM" if tiling.gemm else "GEMV")
    assert found == set(PATHS)
