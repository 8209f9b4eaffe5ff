"""xgrammar's pure-PyTorch bitmask backend under the conformance suite.

`pytest tests/conformance --impl tests.peers.xgrammar_torch` runs the token
mask stage against `xgrammar.apply_token_bitmask_inplace(...,
backend="torch_native")` (`xgrammar/kernels/apply_token_bitmask_inplace_torch.py`),
the backend xgrammar picks for NPU tensors and the code its `torch_compile`
backend compiles: it unpacks the words with `repeat_interleave` and shifts,
and `masked_fill_`s the first `min(V, 32 · words)` columns of the logits (or
of the rows `indices` names), any floating dtype. Glue:
`tests.peers.xgrammar_mask`.
"""

from __future__ import annotations

import importlib.metadata

from tests.peers.xgrammar_mask import adapter

__version__ = importlib.metadata.version("xgrammar")

PEER = {
    "name": "xgrammar torch",
    "package": "xgrammar",
    "functions": 'xgrammar.apply_token_bitmask_inplace(backend="torch_native") on a copy',
}

apply_token_bitmask = adapter("torch_native")

__all__ = ["PEER", "apply_token_bitmask"]
