"""The spec's counter-based generator against published vectors and against Triton's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from decodespec.spec.rng import philox4x32, uniform
from decodespec.spec.sampling import gumbel_noise

# Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF,) * 2,
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.clause("SAMPLE-RNG-1")
@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32(
        tuple(torch.tensor([c], dtype=torch.int64) for c in counter),
        tuple(torch.tensor([k], dtype=torch.int64) for k in key),
    )
    assert tuple(w.item() for w in words) == expected


@pytest.mark.clause("SAMPLE-RNG-1", "SAMPLE-RNG-2")
@given(
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**32 - 1),
    vocab=st.integers(1, 64),
)
def test_spec_generator_equals_triton_philox(seed, step, vocab):
    """Triton's tl.philox (run by its interpreter on CPU) is an independent implementation."""
    triton = pytest.importorskip("triton")
    from tests.triton_philox import first_words

    words = first_words(seed, step, vocab)
    seed64 = torch.tensor([seed - 2**64 if seed >= 2**63 else seed])
    index = torch.arange(vocab, dtype=torch.int64)[None]
    step_t = torch.tensor([[step]], dtype=torch.int64)
    ours, _, _, _ = philox4x32(
        (index, step_t & 0xFFFFFFFF, step_t >> 32, torch.zeros_like(step_t)),
        (seed64[:, None] & 0xFFFFFFFF, (seed64[:, None] >> 32) & 0xFFFFFFFF),
    )
    assert ours[0].tolist() == words, triton.__version__


@pytest.mark.clause("SAMPLE-RNG-2")
def test_uniform_conversion_is_exact_and_open():
    u = uniform(torch.tensor([1, 2**62, -5]), torch.tensor([0, 3, 2**33]), 4096)
    assert u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(
        u.double(),
        uniform(
            torch.tensor([1, 2**62, -5]), torch.tensor([0, 3, 2**33]), 4096, dtype=torch.float64
        ),
    )
    assert u.min().item() >= 2.0**-24 and u.max().item() <= 1 - 2.0**-24


@pytest.mark.clause("SAMPLE-RNG-2")
def test_streams_and_steps_give_independent_numbers():
    seed, step = torch.tensor([42]), torch.tensor([7])
    base = uniform(seed, step, 1000)
    assert not torch.equal(base, uniform(seed, step, 1000, stream=1))
    assert not torch.equal(base, uniform(seed, step + 1, 1000))
    assert not torch.equal(base, uniform(seed + 1, step, 1000))
    # 32 bits of the step above 2^32 matter too.
    assert not torch.equal(base, uniform(seed, step + 2**32, 1000))


@pytest.mark.clause("SAMPLE-CHOICE-1")
def test_gumbel_noise_is_standard_gumbel():
    g = gumbel_noise(torch.tensor([3]), torch.tensor([0]), 200_000)[0].double()
    # Gumbel(0, 1): mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(g.mean().item() - 0.5772156649) < 0.01
    assert abs(g.var().item() - 1.6449340668) < 0.03
