"""Conformance: verification of speculative drafts (spec/speculative.py).

The defining property is statistical: whatever the drafter, the first token a
row emits is distributed as the target's p_0, and, given that it was a
draft that got accepted, the next one as p_1. These tests draw one row per
step of the same request (fresh random numbers for every draw) and compare
the frequencies with a chi-square test at a fixed seed, false-positive rate
1e-3 per test. Exact properties (greedy rows, the bonus token's noise, batch
invariance, validation) are checked directly.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from decodespec.spec import registry
from decodespec.spec.rng import uniform
from decodespec.spec.sampling import greedy
from tests.strategies import DEVICE, LARGE

VERIFY = registry.OPERATIONS["verify_drafts"]
DRAWS = 20_000 if LARGE else 600  # the interpreter spends ~25 ms a row
VOCAB = 6


def distributions(count: int, seed: int, peaked: float = 1.5) -> torch.Tensor:
    """`count` random distributions over VOCAB tokens, some entries exactly 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, VOCAB, generator=g) * peaked
    logits[torch.rand(count, VOCAB, generator=g) < 0.15] = -math.inf
    logits[:, 0] = logits[:, 0].nan_to_num(neginf=0.0)  # at least one token possible
    return torch.softmax(logits, dim=-1)


def one_request(p: torch.Tensor, q: torch.Tensor, drafter: str, num_draft: int, seed: int):
    """DRAWS rows of one request at consecutive steps: drafts drawn from q (or q's mode)."""
    k = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    if drafter == "sampled":
        drafts = torch.stack(
            [torch.multinomial(q[j], DRAWS, True, generator=g) for j in range(k)], 1
        )
        draft_probs = q.expand(DRAWS, k, VOCAB)
    else:  # deterministic (prompt lookup): one-hot draft distributions
        drafts = q.argmax(-1).expand(DRAWS, k)
        draft_probs = torch.nn.functional.one_hot(drafts, VOCAB).to(q.dtype)
    return {
        "draft_tokens": drafts.contiguous().to(DEVICE),
        "draft_probs": draft_probs.contiguous().to(DEVICE),
        "target_probs": p.expand(DRAWS, k + 1, VOCAB).contiguous().to(DEVICE),
        "num_draft": torch.full((DRAWS,), num_draft, device=DEVICE),
        "temperature": torch.ones(DRAWS, device=DEVICE),
        "seed": torch.full((DRAWS,), 20261121, device=DEVICE),
        "step": torch.arange(DRAWS, device=DEVICE) * (k + 1),
    }


def verified(impl, **args):
    """`verify_drafts(**args)`, its result checked against VERIFY-OUTPUT-1 first: a
    wrong result (a row that rolls back too few or too many drafts, a missing
    token) fails an assertion naming the rows, never an IndexError or a bincount
    of −1 deeper in a test."""
    out = impl.op("verify_drafts")(**args)
    batch, k = args["draft_tokens"].shape
    vocab = args["target_probs"].shape[-1]
    tokens, accepted = out.tokens.cpu(), out.num_accepted.cpu()
    assert tokens.dtype == torch.int64 and tokens.shape == (batch, k + 1), (
        f"tokens must be int64 [{batch}, {k + 1}], got {tokens.dtype} {list(tokens.shape)}"
    )
    assert accepted.shape == (batch,), f"num_accepted must be [{batch}], got {accepted.shape}"
    outside = (accepted < 0) | (accepted > args["num_draft"].cpu())
    assert not outside.any(), (
        f"rows {outside.nonzero().flatten().tolist()}: num_accepted outside [0, num_draft]"
    )
    emitted = torch.arange(k + 1)[None, :] <= accepted[:, None]  # num_accepted + 1 tokens
    wrong = torch.where(emitted, (tokens < 0) | (tokens >= vocab), tokens != -1).any(1)
    assert not wrong.any(), (
        f"rows {wrong.nonzero().flatten().tolist()[:8]}: the first num_accepted + 1 tokens "
        f"must lie in [0, {vocab}) and the rest be -1; got {tokens[wrong][:4].tolist()} "
        f"with num_accepted {accepted[wrong][:4].tolist()}"
    )
    return out


def assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(tokens.cpu(), minlength=VOCAB).double()
    possible = probs > 0
    assert counts[~possible].sum() == 0, (counts.tolist(), probs.tolist())
    expected = probs.double()[possible] / probs.double()[possible].sum() * counts.sum()
    result = stats.chisquare(counts[possible].numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (counts.tolist(), expected.tolist(), result)


@pytest.mark.clause("VERIFY-ACCEPT-1", "VERIFY-RESIDUAL-1", "VERIFY-BONUS-1", "VERIFY-OUTPUT-1")
@pytest.mark.boundary("clean-failures")
@pytest.mark.parametrize("drafter", ["sampled", "deterministic"])
@pytest.mark.parametrize("num_draft", [0, 1, 3])
def test_emitted_tokens_follow_the_target(impl, drafter, num_draft):
    p = distributions(4, seed=num_draft)
    q = distributions(3, seed=100 + num_draft)
    args = one_request(p, q, drafter, num_draft, seed=7)
    out = verified(impl, **args)
    first = out.tokens[:, 0].cpu()
    assert_frequencies(first, p[0])
    if num_draft >= 1:
        # Given the first draft was accepted, the next emitted token follows p_1.
        kept = (out.num_accepted >= 1).cpu()
        assert_frequencies(out.tokens[kept, 1].cpu(), p[1])


@pytest.mark.clause("VERIFY-ACCEPT-1")
def test_acceptance_rate_is_the_overlap_of_the_distributions(impl):
    """P(accept draft 0) = Σ_x min(p(x), q(x)) for drafts drawn from q."""
    p, q = distributions(2, seed=3), distributions(1, seed=4)
    out = verified(impl, **one_request(p, q, "sampled", 1, seed=11))
    overlap = torch.minimum(p[0], q[0]).sum().item()
    accepted = int((out.num_accepted >= 1).sum())
    assert stats.binomtest(accepted, DRAWS, overlap).pvalue > 1e-3, (accepted / DRAWS, overlap)


@pytest.mark.clause("VERIFY-RESIDUAL-1")
def test_a_draft_the_target_excludes_is_always_replaced(impl):
    p = distributions(2, seed=5)
    p[0, 2] = 0.0  # the target gives the draft token no mass
    p[0] = p[0] / p[0].sum()
    q = torch.zeros(1, VOCAB)
    q[0, 2] = 1.0
    out = verified(impl, **one_request(p, q, "deterministic", 1, seed=12))
    assert int(out.num_accepted.sum()) == 0
    assert_frequencies(out.tokens[:, 0].cpu(), p[0])
    assert bool((out.tokens[:, 1:] == -1).all())


@pytest.mark.clause("VERIFY-BONUS-1", "VERIFY-OUTPUT-1")
def test_the_bonus_token_uses_the_token_choice_noise(impl):
    """Equal draft and target distributions accept everything; the bonus is
    argmax(ln p_n + G) with the noise `sample` uses at that step (stream 0)."""
    batch, k = 64, 2
    p = distributions(k + 1, seed=6)
    g = torch.Generator().manual_seed(1)
    drafts = torch.stack([torch.multinomial(p[j], batch, True, generator=g) for j in range(k)], 1)
    seed = torch.randint(-(2**62), 2**62, (batch,), generator=g)
    step = torch.randint(0, 2**40, (batch,), generator=g)
    out = verified(
        impl,
        draft_tokens=drafts.to(DEVICE),
        draft_probs=p[:k].expand(batch, k, VOCAB).contiguous().to(DEVICE),
        target_probs=p.expand(batch, k + 1, VOCAB).contiguous().to(DEVICE),
        num_draft=torch.full((batch,), k, device=DEVICE),
        temperature=torch.ones(batch, device=DEVICE),
        seed=seed.to(DEVICE),
        step=step.to(DEVICE),
    )
    assert out.num_accepted.cpu().tolist() == [k] * batch
    assert torch.equal(out.tokens[:, :k].cpu(), drafts)
    u = uniform(seed, step + k, VOCAB, dtype=torch.float64)
    expected = greedy(p[k].double().log() - (-u.log()).log())
    assert torch.equal(out.tokens[:, k].cpu(), expected)


@pytest.mark.clause("VERIFY-GREEDY-1")
def test_greedy_rows_emit_the_targets_argmax_tokens(impl):
    batch, k = 5, 3
    p = distributions(batch * (k + 1), seed=8).view(batch, k + 1, VOCAB)
    p[0, 1, :] = 1 / VOCAB  # a tie: the smallest index wins
    target = greedy(p.view(-1, VOCAB)).view(batch, k + 1)
    drafts = target[:, :k].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % VOCAB  # mismatch at once
    drafts[2, 2] = (drafts[2, 2] + 1) % VOCAB  # mismatch at the last draft
    num_draft = torch.tensor([3, 3, 3, 0, 2])
    draft_probs = torch.nn.functional.one_hot(drafts, VOCAB).float()
    out = verified(
        impl,
        draft_tokens=drafts.to(DEVICE),
        draft_probs=draft_probs.to(DEVICE),
        target_probs=p.to(DEVICE),
        num_draft=num_draft.to(DEVICE),
        temperature=torch.zeros(batch, device=DEVICE),
    )
    assert out.num_accepted.cpu().tolist() == [3, 0, 2, 0, 2]
    expected = [
        target[0].tolist(),
        [target[1, 0].item(), -1, -1, -1],
        [*target[2, :3].tolist(), -1],
        [target[3, 0].item(), -1, -1, -1],
        [*target[4, :3].tolist(), -1],
    ]
    assert out.tokens.cpu().tolist() == expected
    assert target[0, 1].item() == 0


@pytest.mark.clause("VERIFY-OUTPUT-1")
def test_rows_do_not_depend_on_their_batch(impl):
    args = one_request(distributions(3, seed=9), distributions(2, seed=10), "sampled", 2, seed=3)
    args = {k: v[:40] for k, v in args.items()}
    whole = verified(impl, **args)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    shuffled = verified(impl, **{k: v[order] for k, v in args.items()})
    assert torch.equal(shuffled.tokens, whole.tokens[order])
    assert torch.equal(shuffled.num_accepted, whole.num_accepted[order])
    alone = verified(impl, **{k: v[5:6] for k, v in args.items()})
    assert torch.equal(alone.tokens[0], whole.tokens[5])


def valid_args() -> dict:
    q = torch.softmax(torch.randn(2, 2, VOCAB), -1)
    return {
        "draft_tokens": torch.tensor([[1, 2], [0, 0]], device=DEVICE),
        "draft_probs": q.to(DEVICE),
        "target_probs": torch.softmax(torch.randn(2, 3, VOCAB), -1).to(DEVICE),
        "num_draft": torch.tensor([2, 1], device=DEVICE),
        "temperature": torch.tensor([1.0, 0.0], device=DEVICE),
        "seed": torch.tensor([1, 2], device=DEVICE),
        "step": torch.tensor([0, 9], device=DEVICE),
    }


def _set(name, index, value):
    def change(args):
        t = args[name].clone()
        t[index] = value
        return {**args, name: t}

    return change


VERIFY_ERRORS = {
    "draft_tokens 1-D": ("draft_tokens", lambda a: {**a, "draft_tokens": a["draft_tokens"][0]}),
    "draft_tokens float": (
        "draft_tokens",
        lambda a: {**a, "draft_tokens": a["draft_tokens"].float()},
    ),
    "draft token outside": ("draft_tokens", _set("draft_tokens", (0, 1), VOCAB)),
    "draft_probs shape": ("draft_probs", lambda a: {**a, "draft_probs": a["draft_probs"][:, :1]}),
    "draft_probs negative": ("draft_probs", _set("draft_probs", (0, 0, 0), -0.1)),
    "draft_probs zero at the draft": ("draft_probs", _set("draft_probs", (0, 1, 2), 0.0)),
    "target_probs NaN": ("target_probs", _set("target_probs", (1, 2, 3), math.nan)),
    "target_probs positions": (
        "target_probs",
        lambda a: {**a, "target_probs": a["target_probs"][:, :2]},
    ),
    "num_draft above K": ("num_draft", _set("num_draft", 1, 3)),
    "num_draft negative": ("num_draft", _set("num_draft", 0, -1)),
    "temperature negative": ("temperature", _set("temperature", 0, -1.0)),
    "step negative": ("step", _set("step", 1, -1)),
    "seed missing": ("seed", lambda a: {**a, "seed": None}),
}


@pytest.mark.clause("VERIFY-VALID-1")
@pytest.mark.parametrize("mistake", sorted(VERIFY_ERRORS))
def test_verify_rejects_invalid_arguments(impl, mistake):
    name, change = VERIFY_ERRORS[mistake]
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        impl.op("verify_drafts")(**change(valid_args()))


@pytest.mark.clause("VERIFY-VALID-1")
@pytest.mark.parametrize("kind", ["float", "list"])
@pytest.mark.parametrize("name", list(valid_args()))
def test_verify_names_an_argument_that_is_not_a_tensor(impl, name, kind):
    args = valid_args()
    args[name] = 1.5 if kind == "float" else args[name].tolist()
    with pytest.raises(TypeError, match=rf"\b{name}\b"):
        impl.op("verify_drafts")(**args)


@pytest.mark.clause("VERIFY-VALID-1")
@pytest.mark.parametrize("batch", [2, 0])
def test_verify_rejects_an_empty_vocabulary(impl, batch):
    args = {name: t[:batch] for name, t in valid_args().items()}
    args["num_draft"] = torch.zeros_like(args["num_draft"])  # no draft token to look up
    for name in ("draft_probs", "target_probs"):
        args[name] = args[name][..., :0]
    with pytest.raises(ValueError, match=r"\b(draft_probs|target_probs)\b"):
        impl.op("verify_drafts")(**args)


@pytest.mark.clause("VERIFY-VALID-1", "VERIFY-OUTPUT-1")
def test_undrafted_columns_are_ignored(impl):
    args = valid_args()
    args["draft_tokens"][1, 1] = 10**6  # past num_draft[1] = 1: never read
    args["draft_probs"][1, 1] = 0.0
    out = verified(impl, **args)
    assert out.tokens.shape == (2, 3) and out.tokens.dtype == torch.int64
    assert int(out.num_accepted[1]) <= 1
