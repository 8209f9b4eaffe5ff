"""Triton kernels for the hot paths of the decode loop, vendorable.

Each public function here has the same name and signature as an operation of
`decodespec.spec.registry.OPERATIONS`, and imports only torch, triton and modules of this
package, so the folder can be copied into another engine's tree and checked
with `pytest --impl <its module name>`. On a machine without a GPU the
kernels run in the Triton interpreter (set TRITON_INTERPRET=1 before
importing this package; the test configuration does).

Kernels so far: `paged_attention` (with split-KV; see `attention.py`),
`append_kv`, and the sampling stage: `sample`, `process_logits`, `greedy`,
the three filter masks and `uniform` (`sampling.py`), `compute_logprobs`
(`logprobs.py`), and the verification of speculative drafts,
`verify_drafts` (`speculative.py`), and the grammar's token mask,
`apply_token_bitmask` (`token_mask.py`), and the weight-only int4/int8
dequant GEMV/GEMM, `quantized_linear` (`quant_linear.py`). Beside them,
`checks.py` (argument checks and error words) and `workspace.py` (the arrival
counters with which split attention and split-K finish in one launch). The conformance suite
lists the other operations as missing and, with this package as the default
implementation, runs their tests as a self-check of the spec.
"""

from .append import append_kv
from .attention import paged_attention
from .logprobs import Logprobs, compute_logprobs
from .quant_linear import quantized_linear
from .sampling import (
    InvalidLogitsError,
    greedy,
    min_p_mask,
    process_logits,
    sample,
    top_k_mask,
    top_p_mask,
    uniform,
)
from .speculative import Verification, verify_drafts
from .token_mask import apply_token_bitmask

__all__ = [
    "InvalidLogitsError",
    "Logprobs",
    "Verification",
    "append_kv",
    "apply_token_bitmask",
    "compute_logprobs",
    "greedy",
    "min_p_mask",
    "paged_attention",
    "process_logits",
    "quantized_linear",
    "sample",
    "top_k_mask",
    "top_p_mask",
    "uniform",
    "verify_drafts",
]
