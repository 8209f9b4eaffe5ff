"""The reference engine's native decode step (C) as `paged_attention` and `append_kv`.

`decodespec serve`'s torch backend runs short passes of int8/int4 models
through `decodespec.reference.native_step`, whose attention is one C call:
RoPE, then the library's `append_kv` and `paged_attention`, which
`decodespec.reference.native_attention` exposes with the spec's signatures.
float32 only (the engine's KV cache): the other dtypes are declared
unsupported and skip. `make peers` runs the batch-invariance checker on it;
`make docs-report` runs the whole suite (docs/conformance-report-native.json).
"""

from __future__ import annotations

from decodespec.reference.native_attention import (
    CONFORMANCE_UNSUPPORTED,
    append_kv,
    paged_attention,
)

PEER = {
    "name": "decodespec native step",
    "package": "decodespec",
    "functions": "decodespec.reference.native_attention.paged_attention and append_kv "
    "(reference/native_step.c, the functions the native decode step calls)",
}

__all__ = ["CONFORMANCE_UNSUPPORTED", "PEER", "append_kv", "paged_attention"]
