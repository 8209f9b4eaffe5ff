"""llguidance's numpy bitmask function under the conformance suite.

`pytest tests/conformance --impl tests.peers.llguidance_numpy` runs the
token mask stage against `llguidance.numpy.apply_token_bitmask_inplace`:
logits wider than `32 · words` get −inf past the bitmask, then the words
are unpacked with `np.repeat` and shifts and every zero bit's column is set
to −inf. The glue copies the logits to a numpy array (the function masks in
place; the spec returns new logits) and the bitmask to another, calls it,
and returns the array as a tensor on the logits' device. An argument that is
not a tensor is passed as it came.

llguidance takes no `indices`: it masks every row of the arrays it is
given, and an engine passes it the rows of its grammar requests. Given
`indices`, the adapter raises NotImplementedError rather than choose rows
for it. numpy has no bfloat16 (`CONFORMANCE_UNSUPPORTED`).
"""

from __future__ import annotations

import importlib.metadata

import torch
from llguidance.numpy import apply_token_bitmask_inplace
from torch import Tensor

__version__ = importlib.metadata.version("llguidance")

PEER = {
    "name": "llguidance numpy",
    "package": "llguidance",
    "functions": "llguidance.numpy.apply_token_bitmask_inplace on numpy copies",
}
CONFORMANCE_UNSUPPORTED = {"bfloat16": "numpy has no bfloat16 dtype"}


def _numpy(value: object) -> object:
    return value.detach().cpu().numpy().copy() if isinstance(value, Tensor) else value


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, indices: Tensor | None = None) -> Tensor:
    """llguidance.numpy.apply_token_bitmask_inplace on numpy copies; `indices` raises
    NotImplementedError (llguidance masks every row it is given)."""
    if indices is not None:
        raise NotImplementedError("llguidance's apply_token_bitmask_inplace takes no indices")
    out = _numpy(logits)
    apply_token_bitmask_inplace(out, _numpy(bitmask))
    return torch.from_numpy(out).to(logits.device)


__all__ = ["PEER", "apply_token_bitmask"]
