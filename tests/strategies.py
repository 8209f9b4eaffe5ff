"""Hypothesis strategies for the conformance suite.

Shapes are small where kernels run in the Triton interpreter (no GPU) and
large on a GPU; DECODESPEC_SIZES=small|large overrides. Tensors are built
from a drawn seed rather than drawn element by element: far faster, and the
failing tensor is printed as a reproduction anyway.
"""

from __future__ import annotations

import math
import os

import torch
from hypothesis import strategies as st

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LARGE = os.environ.get("DECODESPEC_SIZES", "large" if DEVICE.type == "cuda" else "small") == "large"
MAX_BATCH = 64 if LARGE else 4
MAX_VOCAB = 262_144 if LARGE else 300
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The `thorough` hypothesis profile also draws the heavier boundary cases.
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"

# How a row of logits looks: spread-out values, heavy ties, bf16-rounded
# values (ties from rounding), or a huge dynamic range.
LOGIT_KINDS = ("normal", "integers", "bf16_rounded", "wide")


def make_logits(
    batch: int, vocab: int, kind: str, seed: int, masked_fraction: float = 0.0
) -> torch.Tensor:
    """float32 `[batch, vocab]` logits of the given kind; every row keeps a finite entry."""
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(batch, vocab, generator=g) * 3
    elif kind == "integers":
        x = torch.randint(-3, 4, (batch, vocab), generator=g).float()
    elif kind == "bf16_rounded":
        x = (torch.randn(batch, vocab, generator=g) * 4).to(torch.bfloat16).float()
    elif kind == "wide":
        x = torch.randn(batch, vocab, generator=g) * 200
    else:
        raise ValueError(kind)
    if masked_fraction > 0:
        masked = torch.rand(batch, vocab, generator=g) < masked_fraction
        masked[torch.arange(batch), torch.randint(vocab, (batch,), generator=g)] = False
        x = x.masked_fill(masked, -math.inf)
    return x


@st.composite
def logits(
    draw: st.DrawFn,
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    min_vocab: int = 1,
    max_vocab: int | None = None,
    max_batch: int | None = None,
    kinds: tuple[str, ...] = LOGIT_KINDS,
    masked: bool = True,
) -> torch.Tensor:
    """`[batch, vocab]` logits on DEVICE in one of `dtypes`, rounded to that dtype."""
    batch = draw(st.integers(1, max_batch or MAX_BATCH))
    vocab = draw(st.integers(min_vocab, max_vocab or MAX_VOCAB))
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(dtypes))
    fraction = draw(st.sampled_from((0.0, 0.0, 0.3, 0.9))) if masked else 0.0
    seed = draw(st.integers(0, 2**32 - 1))
    x = make_logits(batch, vocab, kind, seed, fraction).to(dtype)
    return x.to(DEVICE)


def per_row(draw: st.DrawFn, batch: int, values: st.SearchStrategy, dtype: torch.dtype):
    return torch.tensor([draw(values) for _ in range(batch)], dtype=dtype, device=DEVICE)


def temperatures(greedy: bool = True) -> st.SearchStrategy[float]:
    """Temperatures, 0 (greedy) among them unless `greedy` is False. Drawn without a
    filter: a filter that rejects a third of the draws fails a whole batch of 64 rows."""
    sampled = st.one_of(st.sampled_from((1e-6, 0.1, 0.7, 1.0, 2.5)), st.floats(0.05, 3.0))
    return st.one_of(st.just(0.0), sampled) if greedy else sampled


def top_ks(vocab: int) -> st.SearchStrategy[int]:
    return st.sampled_from((0, 0, 1, 2, 5, max(1, vocab // 2), vocab, vocab + 3))


def top_ps() -> st.SearchStrategy[float]:
    return st.one_of(st.just(1.0), st.sampled_from((0.1, 0.5, 0.9)), st.floats(0.01, 0.99))


def min_ps() -> st.SearchStrategy[float]:
    return st.one_of(st.just(0.0), st.sampled_from((0.05, 0.5, 1.0)), st.floats(0.0, 1.0))


@st.composite
def sampling_args(draw: st.DrawFn, batch: int, vocab: int, greedy: bool | None = None) -> dict:
    """Per-row sampling tensors (no processors) for a `[batch, vocab]` call."""
    if greedy is None:
        temps = st.one_of(st.just(0.0), temperatures())
    else:
        temps = st.just(0.0) if greedy else temperatures(greedy=False)
    return {
        "temperature": per_row(draw, batch, temps, torch.float32),
        "top_k": per_row(draw, batch, top_ks(vocab), torch.int64),
        "top_p": per_row(draw, batch, top_ps(), torch.float32),
        "min_p": per_row(draw, batch, min_ps(), torch.float32),
        "seed": per_row(draw, batch, st.integers(-(2**63), 2**63 - 1), torch.int64),
        "step": per_row(draw, batch, st.integers(0, 2**40), torch.int64),
    }


# ---------------------------------------------------------------- boundaries
#
# Random draws almost never land where implementations differ: on exact ties,
# exact thresholds, chunk and tile boundaries. These strategies aim there on
# purpose; tests that draw them say so with `@pytest.mark.boundary(family)`,
# and the clause report lists, per clause, the families its tests draw.

BOUNDARY_FAMILIES = {
    "ties-across-chunks": "exact ties between token ids in different vocabulary chunks",
    "exact-thresholds": "a token exactly at a filter's threshold (top-p mass, min-p ratio)",
    "many-kv-tiles": "sequences spanning several KV tiles and splits, in every dtype",
    "clean-failures": "a wrong result fails an assertion on the whole output, not a crash",
}

# Vocabulary chunks of chunked kernels: ours walk 4096 entries at a time in the
# Triton interpreter and 1024 on a GPU. Ids below the smaller size, and in
# different multiples of the larger one, sit in different chunks for either size.
CHUNK_SIZES = (1024, 4096)


@st.composite
def far_apart_ids(draw: st.DrawFn, count: int) -> tuple[int, list[int]]:
    """`(vocab, ids)`: `count` ids in different chunks for every size in CHUNK_SIZES,
    the first below the smallest chunk, the i-th in the i-th multiple of the largest."""
    large = max(CHUNK_SIZES)
    vocab = draw(st.integers(large * (count - 1) + 1, large * count))
    ids = [draw(st.integers(0, min(CHUNK_SIZES) - 1))]
    ids += [draw(st.integers(large * i, min(large * (i + 1), vocab) - 1)) for i in range(1, count)]
    return vocab, ids


def dyadic_probabilities(draw: st.DrawFn, max_splits: int = 6) -> list[int]:
    """Exponents e_i of a distribution 2^-e_i summing to exactly 1: start from
    one token of probability 1 and split tokens in halves."""
    exponents = [0]
    for _ in range(draw(st.integers(1, max_splits))):
        i = draw(st.integers(0, len(exponents) - 1))
        exponents[i : i + 1] = [exponents[i] + 1] * 2
    return exponents
