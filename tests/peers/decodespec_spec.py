"""The spec's own operations as an implementation under test (`--impl`).

`make peers` runs the batch-invariance checker on it beside our kernels and
the engine's torch backend: the definition itself computes a row the same way
whatever its batch (ATTN-INVARIANT-1, SAMPLE-INVARIANT-1, VERIFY-OUTPUT-1).
"""

from __future__ import annotations

from decodespec.spec.registry import OPERATIONS

PEER = {
    "name": "decodespec spec",
    "package": "decodespec",
    "functions": "every operation of decodespec.spec.registry.OPERATIONS, as the spec defines it",
}

globals().update({name: op.reference for name, op in OPERATIONS.items()})
