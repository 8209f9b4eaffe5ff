"""llguidance's torch bitmask function under the conformance suite.

`pytest tests/conformance --impl tests.peers.llguidance_torch` runs the
token mask stage against `llguidance.torch.apply_token_bitmask_inplace`:
logits wider than `32 · words` get −inf past the bitmask, then a
`torch.compile`d kernel unpacks the words with `repeat_interleave` and
shifts and `masked_fill_`s every zero bit's column with −inf. The glue
copies the logits (the function masks in place; the spec returns new
logits) and passes the bitmask as it comes; so is an argument that is not a
tensor.

llguidance takes no `indices`: it masks every row of the tensors it is
given, and an engine passes it the rows of its grammar requests. Given
`indices`, the adapter raises NotImplementedError rather than choose rows
for it.
"""

from __future__ import annotations

import importlib.metadata

from llguidance.torch import apply_token_bitmask_inplace
from torch import Tensor

__version__ = importlib.metadata.version("llguidance")

PEER = {
    "name": "llguidance torch",
    "package": "llguidance",
    "functions": "llguidance.torch.apply_token_bitmask_inplace (torch.compile) on a copy",
}


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None) -> Tensor:
    """llguidance.torch.apply_token_bitmask_inplace on a copy of the logits; `indices`
    raises NotImplementedError (llguidance masks every row it is given)."""
    if indices is not None:
        raise NotImplementedError("llguidance's apply_token_bitmask_inplace takes no indices")
    out = logits.clone() if isinstance(logits, Tensor) else logits
    apply_token_bitmask_inplace(out, bitmask)
    return out


__all__ = ["PEER", "apply_token_bitmask"]
