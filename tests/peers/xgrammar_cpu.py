"""xgrammar's CPU bitmask kernel under the conformance suite.

`pytest tests/conformance --impl tests.peers.xgrammar_cpu` runs the token
mask stage against `xgrammar.apply_token_bitmask_inplace(..., backend="cpu")`,
the backend xgrammar picks for CPU tensors: a C++ loop over float32,
float16 or bfloat16 logits (`xgrammar/kernels/apply_token_bitmask_inplace_cpu.py`
hands it raw pointers and strides). Glue: `tests.peers.xgrammar_mask`.

xgrammar's other kernels: `xgrammar_torch` is its pure-PyTorch backend.
Its Triton kernel is not run here: the wrapper that launches it
(`apply_token_bitmask_inplace_triton`) reads the GPU's multiprocessor count
and architecture from `torch.cuda.get_device_properties` before the launch,
so it fails on a machine without CUDA before the Triton interpreter is
reached, and launching the `@triton.jit` kernel without that wrapper would
mean writing its launch ourselves. Its `torch_compile` backend is the torch
backend's code under `torch.compile` (the same function), and its `cuda`
backend needs a GPU.
"""

from __future__ import annotations

import importlib.metadata

from tests.peers.xgrammar_mask import adapter

__version__ = importlib.metadata.version("xgrammar")

PEER = {
    "name": "xgrammar CPU",
    "package": "xgrammar",
    "functions": 'xgrammar.apply_token_bitmask_inplace(backend="cpu") on a copy of the logits',
}
CONFORMANCE_UNSUPPORTED = {
    "float64": "xgrammar's CPU kernel takes float32, float16 and bfloat16 logits only",
}

apply_token_bitmask = adapter("cpu")

__all__ = ["PEER", "apply_token_bitmask"]
