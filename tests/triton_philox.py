"""Triton's own Philox (tl.philox), as an independent check of the spec's generator.

Kept out of kernels/: it is a test oracle, not a kernel of the project.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _philox_first_word(out_ptr, seed, step_lo, step_hi, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    zero = tl.zeros_like(offsets).to(tl.uint32)
    c0 = offsets.to(tl.uint32)
    # Scalars of 2^31 and more arrive as int64: truncate to the 32-bit words.
    c1 = zero + step_lo.to(tl.uint32)
    c2 = zero + step_hi.to(tl.uint32)
    w0, _, _, _ = tl.philox(seed, c0, c1, c2, zero)
    tl.store(out_ptr + offsets, w0.to(tl.int64) & 0xFFFFFFFF, mask=offsets < n)


def first_words(seed: int, step: int, vocab: int) -> list[int]:
    """First Philox4x32-10 output word for counters (i, step_lo, step_hi, 0), i < vocab."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(vocab, dtype=torch.int64, device=device)
    seed64 = seed - 2**64 if seed >= 2**63 else seed
    block = 64
    _philox_first_word[(triton.cdiv(vocab, block),)](
        out, seed64, step & 0xFFFFFFFF, step >> 32, vocab, BLOCK=block
    )
    return out.cpu().tolist()
