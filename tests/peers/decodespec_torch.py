"""The reference engine's `torch` backend attention as `paged_attention`.

`decodespec serve`'s default backend attends to a group of sequences at once,
each padded to the group's longest (`decodespec.reference.batched_attention`):
fast on a CPU, and the reason `--batch-invariant` replaces it with the spec's
attention. `make peers` runs the batch-invariance checker on it.
"""

from __future__ import annotations

from decodespec.reference.batched_attention import paged_attention

PEER = {
    "name": "decodespec torch backend",
    "package": "decodespec",
    "functions": "decodespec.reference.batched_attention.paged_attention",
}

__all__ = ["PEER", "paged_attention"]
