"""xgrammar's `apply_token_bitmask_inplace` as the spec's `apply_token_bitmask`.

Shared by the xgrammar adapters (`xgrammar_cpu`, `xgrammar_torch`), which
differ only in the backend they name. The glue copies the logits (xgrammar
masks in place; the spec returns new logits) and passes the bitmask and
`indices` through as they come, so that xgrammar's own checks (or their
absence) are what a test sees. `vocab_size` is left out: the spec has no
such argument (the vocabulary is the logits' width), and xgrammar then masks
`min(V, 32 · words)` columns.

The copy is contiguous, as an engine's logits are, and is followed by a
guard of 32 zeros. xgrammar 0.2.8's CPU kernel can write −inf past a
row's end, into the same word's positions past the vocabulary (the first
disallowed bit of a row's last word even when it lies past V): in a batch
that lands on the next rows' first tokens, which the tests see; past the
last row it would corrupt the heap and abort the test process, so the guard
takes it instead and the adapter raises RuntimeError saying so. An argument
that is not a tensor is passed as it came.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import xgrammar
from torch import Tensor

GUARD = 32  # a write past a row stays inside its last 32-bit word


def adapter(backend: str) -> Callable[..., Tensor]:
    """`apply_token_bitmask(logits, bitmask, indices=None)` through xgrammar's `backend`."""

    def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None):
        out = logits
        if isinstance(logits, Tensor):
            buffer = torch.zeros(logits.numel() + GUARD, dtype=logits.dtype, device=logits.device)
            out = buffer[: logits.numel()].view(logits.shape).copy_(logits)
        with warnings.catch_warnings():
            # xgrammar warns when the bitmask is narrower than the logits; what it then
            # does to the columns past the bitmask is what the suite checks.
            warnings.simplefilter("ignore", UserWarning)
            xgrammar.apply_token_bitmask_inplace(out, bitmask, indices=indices, backend=backend)
        if isinstance(logits, Tensor) and bool((buffer[logits.numel() :] != 0).any()):
            raise RuntimeError(f"xgrammar ({backend}) wrote past the end of the logits")
        return out

    apply_token_bitmask.__doc__ = (
        f"xgrammar.apply_token_bitmask_inplace(copy, bitmask, indices=indices, "
        f"backend={backend!r}) on a contiguous copy of the logits; returns the copy."
    )
    return apply_token_bitmask
