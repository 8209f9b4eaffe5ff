"""What the Triton sampling kernels promise beyond the conformance suite's shapes.

The conformance suite (tests/conformance/test_sampling.py) checks every
sampling clause on small vocabularies in the interpreter. This module adds
vocabularies that span several of the kernel's chunks and are not a
multiple of any block size (real ones on a GPU: 128,256, 151,936 and
262,144), tie-heavy rows, run-to-run determinism, and the wrappers'
refusals.
"""

from __future__ import annotations

import pytest
import torch

from decodespec import kernels
from decodespec.spec import sampling as spec
from tests.conformance.test_sampling import assert_tokens_conform
from tests.strategies import DEVICE, LARGE

VOCABS = (128_256, 151_936, 262_144) if LARGE else (5_000,)  # 5,000: two interpreter chunks


def row_params(batch: int, seed: int) -> dict:
    """Greedy and sampled rows, each filter alone and together, per-row seeds and steps."""
    g = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9, 1.0])[:batch]
    return {
        "temperature": temperature.to(DEVICE),
        "top_k": torch.tensor([0, 50, 0, 0, 7, 1])[:batch].to(DEVICE),
        "top_p": torch.tensor([1.0, 0.9, 0.8, 1.0, 0.95, 0.5])[:batch].to(DEVICE),
        "min_p": torch.tensor([0.0, 0.0, 0.0, 0.1, 0.05, 0.0])[:batch].to(DEVICE),
        "seed": torch.randint(-(2**62), 2**62, (batch,), generator=g).to(DEVICE),
        "step": torch.randint(0, 2**40, (batch,), generator=g).to(DEVICE),
    }


def peaked_logits(batch: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Like a language model's: a long tail and a few strong candidates, some tied."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g) * 2
    top = torch.randint(0, vocab, (batch, 8), generator=g)
    x.scatter_(1, top, 8.0 + torch.randint(0, 3, (batch, 8), generator=g).float())
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tokens_over_several_chunks_match_the_spec(vocab, dtype):
    x = peaked_logits(6, vocab, dtype, seed=vocab)
    args = row_params(6, seed=1)
    tokens = kernels.sample(x, **args)
    assert_tokens_conform(x, args, tokens)


@pytest.mark.parametrize("vocab", VOCABS)
def test_processed_logits_over_several_chunks_equal_the_spec(vocab):
    x = peaked_logits(6, vocab, torch.float32, seed=vocab + 1)
    args = row_params(6, seed=2)
    del args["seed"]
    ours = kernels.process_logits(x, **args)
    ref = spec.process_logits(x, **args)
    # The same float32 operations, each rounded once: equal, up to the thresholds'
    # decisions on values within rounding of them (none in these rows).
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.equal(ours[torch.isfinite(ref)], ref[torch.isfinite(ref)])


@pytest.mark.clause("SAMPLE-GREEDY-1")
@pytest.mark.parametrize("process_logits", [spec.process_logits, kernels.process_logits])
def test_processed_logits_of_greedy_rows_skip_the_filters(process_logits):
    """Greedy rows come back processed and shifted, never filtered (the engine's
    "processed" logprobs of a greedy request with top-k, top-p or min-p set)."""
    x = peaked_logits(3, 300, torch.float32, seed=11)
    args = {
        "temperature": torch.zeros(3, device=DEVICE),
        "top_k": torch.tensor([5, 0, 0], device=DEVICE),
        "top_p": torch.tensor([1.0, 0.5, 1.0], device=DEVICE),
        "min_p": torch.tensor([0.0, 0.0, 0.05], device=DEVICE),
    }
    out = process_logits(x, **args)
    assert torch.equal(out, x - x.amax(dim=-1, keepdim=True))


@pytest.mark.parametrize("vocab", VOCABS)
def test_logprobs_over_several_chunks_match_the_spec(vocab):
    x = peaked_logits(4, vocab, torch.float32, seed=vocab + 2)
    token_ids = torch.tensor([0, 1, vocab - 1, vocab // 2], device=DEVICE)
    ours = kernels.compute_logprobs(x, token_ids, 20)
    ref = spec.compute_logprobs(x.double(), token_ids, 20)
    torch.testing.assert_close(ours.token_logprobs.double(), ref.token_logprobs, rtol=0, atol=1e-5)
    assert torch.equal(ours.ranks, ref.ranks)
    assert torch.equal(ours.top_token_ids, ref.top_token_ids)


def test_the_same_inputs_give_the_same_tokens():
    x = peaked_logits(6, 3_000, torch.bfloat16, seed=5)
    args = row_params(6, seed=3)
    first = kernels.sample(x, **args)
    assert torch.equal(kernels.sample(x, **args), first)
    assert torch.equal(kernels.sample(x.clone(), **{k: v.clone() for k, v in args.items()}), first)


def test_float64_logits_are_refused_clearly():
    x = torch.zeros(1, 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(ValueError, match=r"logits must be float16, bfloat16 or float32"):
        kernels.sample(x, temperature=torch.zeros(1, device=DEVICE))


def test_cpu_tensors_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(kernels.checks, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"logits.*TRITON_INTERPRET"):
        kernels.sample(torch.zeros(1, 4), temperature=torch.zeros(1))


@pytest.mark.parametrize("stream", [0, 1, 2**31 + 5, 2**32 - 1])
def test_every_stream_is_bit_identical_to_the_spec(stream):
    seed = torch.tensor([3, -1, 2**62], device=DEVICE)
    step = torch.tensor([0, 5, 2**40], device=DEVICE)
    ours = kernels.uniform(seed, step, 50, stream=stream)
    assert torch.equal(ours.cpu(), spec.uniform(seed.cpu(), step.cpu(), 50, stream=stream))
