"""Random numbers for sampling: the Philox4x32-10 generator and the uniform number of each token.

`sample` turns these numbers into its Gumbel noise (SAMPLE-CHOICE-1), and
speculative verification draws its acceptance and residual numbers from other
streams of the same generator (`decodespec.spec.speculative`). They are
defined bit for bit, so every backend draws the same ones.

[SAMPLE-RNG-1] The generator is Philox4x32-10 (Salmon et al., SC'11; the
Random123 definition): 10 rounds over a counter (c0, c1, c2, c3) of 32-bit
words with key (k0, k1); each round maps the counter to
(hi(M1·c2) ⊕ c1 ⊕ k0, lo(M1·c2), hi(M0·c0) ⊕ c3 ⊕ k1, lo(M0·c0)) with
M0 = 0xD2511F53, M1 = 0xCD9E8D57, and the key is bumped by
(0x9E3779B9, 0xBB67AE85) modulo 2^32 between rounds.

[SAMPLE-RNG-2] The random number of vocabulary index i for a request with
64-bit seed s at step t (the number of tokens it has generated so far) is
built from the key (s mod 2^32, ⌊s / 2^32⌋) and the counter
(i, t mod 2^32, ⌊t / 2^32⌋, stream), stream 0 being token choice (other
streams are reserved for other stages). Of the four output words only the
first, w, is used: `U_i = (2·⌊w / 2^9⌋ + 1) / 2^24`, exactly representable in
float32 and strictly inside (0, 1). U is bit-identical on every backend; G
is computed from it in float32 and may differ by a few ulps between math
libraries.

[SAMPLE-RNG-3] U depends only on (seed, step, vocabulary index, stream): a
request's tokens do not depend on the other requests in its batch, on its
row, or on the batch size (batch invariance), and the same seed, prompt and
parameters give the same tokens on every backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .softmax import check_tensor

_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = 0xFFFFFFFF
STREAM_TOKEN_CHOICE = 0


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of the 64-bit product a·b (a, b < 2^32).

    Computed in 16-bit halves so that no int64 intermediate overflows.
    """
    low_part = a * (b & 0xFFFF)  # < 2^48
    mid = a * (b >> 16) + (low_part >> 16)  # a·b = mid·2^16 + low_part mod 2^16
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox4x32(
    counter: tuple[Tensor, Tensor, Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    rounds: int = 10,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 (SAMPLE-RNG-1) on int64 tensors holding 32-bit words.

    Args:
        counter: four broadcastable int64 tensors with values in [0, 2^32).
        key: two broadcastable int64 tensors with values in [0, 2^32).

    Returns:
        The four output words, int64 tensors with values in [0, 2^32).

    Example (a Random123 known-answer vector):
        >>> z = torch.zeros(1, dtype=torch.int64)
        >>> [hex(w.item()) for w in philox4x32((z, z, z, z), (z, z))]
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r > 0:
            k0 = (k0 + _PHILOX_W0) & _LOW32
            k1 = (k1 + _PHILOX_W1) & _LOW32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniform(
    seed: Tensor,
    step: Tensor,
    vocab_size: int,
    stream: int = STREAM_TOKEN_CHOICE,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`[batch, vocab_size]` uniform numbers U of each row (SAMPLE-RNG-2, SAMPLE-RNG-3).

    Args:
        seed: `[batch]` int64, the bit pattern of each row's 64-bit seed.
        step: `[batch]` int64 >= 0, tokens the row has generated so far.
        vocab_size: number of vocabulary indices.
        stream: which independent stream (0: token choice).
        dtype: float32 or float64 (the values are the same: they are exact).
    """
    check_tensor("seed", seed)
    check_tensor("step", step)
    device = seed.device
    seed = seed.to(torch.int64)[:, None]
    step = step.to(device=device, dtype=torch.int64)[:, None]
    index = torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]
    word, _, _, _ = philox4x32(
        (index, step & _LOW32, step >> 32, torch.full_like(step, stream)),
        (seed & _LOW32, (seed >> 32) & _LOW32),
    )
    return (2 * (word >> 9) + 1).to(dtype) * 2.0**-24
