"""Speculative decoding: verify a run of draft tokens against the target model.

A cheap drafter proposes up to K tokens; the target model scores all of them
in one forward pass (attention with q_len = K + 1, ATTN-CAUSAL-1); this stage
decides how many drafts to keep and which token follows them, so that the
emitted tokens are distributed exactly as if the target had sampled them one
at a time (speculative sampling, Leviathan et al. and Chen et al., 2023).

Per row the inputs are the drafts x_0 .. x_{n−1} (n = `num_draft[b]`, 0 <= n
<= K), the draft distributions q_0 .. q_{n−1} they were drawn from, and the
target distributions p_0 .. p_n at the same positions (p_n follows the last
draft). Both are the distributions tokens are drawn from, softmax of
`decodespec.spec.sampling.process_logits` with the row's parameters for each model, so
temperature, top-k, top-p, min-p and the processors apply to both (SEMANTICS.md,
"Speculative decoding"). A deterministic drafter (prompt lookup) has one-hot
q_j. `step[b]` is the number of tokens the row generated before x_0: draft j
is the row's token number `step + j`.

[VERIFY-ACCEPT-1] Draft j is accepted iff `U_j · q_j(x_j) < p_j(x_j)`, that is
with probability `min(1, p_j(x_j) / q_j(x_j))`, where `U_j` is the spec's
uniform number for (seed, step + j, index 0, stream 1) (SAMPLE-RNG-2). Drafts
are checked in order; the first rejection ends the run and the drafts after
it are discarded, whatever their numbers.

[VERIFY-RESIDUAL-1] At the first rejection, at position j, the row's next
token is drawn from the residual distribution `r ∝ max(p_j − q_j, 0)`: it is
`argmax_i (ln r_i + G_i)` over the tokens with r_i > 0, with
`G_i = −ln(−ln U_i)`, U_i the uniform number for (seed, step + j, i, stream
2), ties to the smallest index. If rounding leaves r all zero, p_j takes its
place.

[VERIFY-BONUS-1] When all n drafts are accepted the row emits one more token,
drawn from p_n with the token-choice stream (stream 0) at step + n:
`argmax_i (ln p_n,i + G_i)` over p_n,i > 0, the noise `sample` would use for
that token (SAMPLE-CHOICE-1). A row without drafts (n = 0) is plain sampling.

[VERIFY-GREEDY-1] A row with temperature 0 is greedy: draft j is accepted iff
it equals `argmax p_j` (the smallest index of the maximum); the first
mismatch is replaced by `argmax p_j`; if every draft is accepted the bonus
token is `argmax p_n`. No random number is used, and the emitted tokens are
those of plain greedy decoding.

[VERIFY-OUTPUT-1] The result holds, per row, the emitted tokens (the accepted
drafts, then the residual or bonus token: `num_accepted + 1` tokens) padded
with −1 to K + 1 columns, and `num_accepted`. A row's result depends only on
its own inputs, seed and step (batch invariance, SAMPLE-RNG-3).

[VERIFY-VALID-1] Invalid arguments raise `ValueError` naming the argument:
shapes (`draft_tokens` `[batch, K]`, `draft_probs` `[batch, K, vocab]`,
`target_probs` `[batch, K + 1, vocab]`, `num_draft`, `temperature`, `seed`,
`step` `[batch]`), dtypes (integer tokens, counts, seeds and steps; float
probabilities), `num_draft` in [0, K], the first `num_draft[b]` drafts inside
the vocabulary with `q_j(x_j) > 0` (a drafter cannot propose a token it gave
probability 0), probabilities finite and >= 0, temperature finite and >= 0,
`step` >= 0, a seed whenever a row has temperature > 0, and a vocabulary of
at least one token: probabilities with a last dimension of size 0 raise
`ValueError` naming the probability tensor, for example "target_probs must
have at least one column (vocabulary size 0)". An argument that is not a
`torch.Tensor` at all (a Python number, a list; None for a required one)
raises `TypeError` naming it instead, for example "temperature must be a
torch.Tensor, got float" (the spec's `ArgumentTypeError`, also a
`ValueError`, SOFTMAX-VALID-1); `seed` and `step` may be None.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .checks import check_range
from .rng import STREAM_TOKEN_CHOICE, uniform
from .sampling import greedy
from .softmax import check_tensor, check_vocabulary, compute_dtype

STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2


class Verification(NamedTuple):
    """What `verify_drafts` returns, per row."""

    tokens: Tensor  # [batch, K + 1] int64: accepted drafts, then one more token; −1 after
    num_accepted: Tensor  # [batch] int64


def _check_integer(name: str, t: Tensor, shape: list[int]) -> None:
    if list(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")


def _check_probs(name: str, t: Tensor, shape: list[int]) -> None:
    if list(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must have a floating-point dtype, got {t.dtype}")
    if not bool((torch.isfinite(t) & (t >= 0)).all()):
        raise ValueError(f"{name} must hold finite probabilities >= 0")


def _check_types(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor | None,
) -> None:
    """VERIFY-VALID-1: every tensor argument is a tensor (`seed` and `step` may be None)."""
    for name, t in (
        ("draft_tokens", draft_tokens),
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
        ("num_draft", num_draft),
        ("temperature", temperature),
        ("seed", seed),
        ("step", step),
    ):
        if t is not None or name not in ("seed", "step"):
            check_tensor(name, t)


def _check(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    temperature: Tensor,
    seed: Tensor | None,
    step: Tensor,
) -> None:
    """VERIFY-VALID-1, on arguments that passed `_check_types`."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape [batch, K], got {list(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    _check_integer("draft_tokens", draft_tokens, [batch, k])
    if target_probs.dim() != 3:
        raise ValueError(
            f"target_probs must have shape [batch, K + 1, vocab], got {list(target_probs.shape)}"
        )
    vocab = check_vocabulary("target_probs", target_probs)
    _check_probs("target_probs", target_probs, [batch, k + 1, vocab])
    _check_probs("draft_probs", draft_probs, [batch, k, vocab])
    _check_integer("num_draft", num_draft, [batch])
    check_range("num_draft", num_draft, 0, k)
    if list(temperature.shape) != [batch]:
        raise ValueError(f"temperature must have shape [{batch}], got {list(temperature.shape)}")
    check_range("temperature", temperature, 0, float("inf"), high_open=True)
    _check_integer("step", step, [batch])
    check_range("step", step, 0, float("inf"), high_open=True)
    if seed is None:
        if bool((temperature > 0).any()):
            raise ValueError("seed is required when a row has temperature > 0")
    else:
        _check_integer("seed", seed, [batch])
    drafted = torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]
    outside = drafted & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(outside.any()):
        b, j = outside.nonzero()[0].tolist()
        token = int(draft_tokens[b, j])
        raise ValueError(f"draft_tokens[{b}, {j}] = {token} is not in [0, {vocab})")
    q_x = draft_probs.gather(-1, draft_tokens.clamp(0, vocab - 1).long()[..., None])[..., 0]
    impossible = drafted & (q_x == 0)
    if bool(impossible.any()):
        b, j = impossible.nonzero()[0].tolist()
        raise ValueError(
            f"draft_probs[{b}, {j}] gives the draft token {int(draft_tokens[b, j])} "
            "probability 0: the drafter cannot have drawn it"
        )


def _gumbel_choice(probs: Tensor, seed: Tensor, step: Tensor, stream: int) -> Tensor:
    """`argmax_i (ln probs_i + G_i)` per row, ties to the smallest index."""
    u = uniform(seed, step, probs.shape[-1], stream=stream, dtype=probs.dtype)
    return greedy(probs.log() - (-u.log()).log())


def verify_drafts(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    num_draft: Tensor,
    *,
    temperature: Tensor,
    seed: Tensor | None = None,
    step: Tensor | None = None,
) -> Verification:
    """Accept a prefix of each row's drafts and choose the token that follows it.

    (VERIFY-ACCEPT-1, VERIFY-RESIDUAL-1, VERIFY-BONUS-1, VERIFY-GREEDY-1,
    VERIFY-OUTPUT-1, VERIFY-VALID-1.)

    Args:
        draft_tokens: `[batch, K]` int, row b's drafts in its first
            `num_draft[b]` columns (the rest is ignored).
        draft_probs: `[batch, K, vocab]` float, the distribution each draft
            was drawn from.
        target_probs: `[batch, K + 1, vocab]` float, the target's distribution
            at each draft position and after the last one.
        num_draft: `[batch]` int in [0, K].
        temperature: `[batch]` float >= 0; 0 makes the row greedy.
        seed: `[batch]` int64 seeds; required when a row has temperature > 0.
        step: `[batch]` int64 >= 0, tokens each row generated before its
            first draft (default 0).

    Returns:
        `Verification(tokens, num_accepted)`: `[batch, K + 1]` int64 emitted
        tokens padded with −1, and `[batch]` int64 accepted counts.

    Raises:
        ValueError: an argument has the wrong shape, dtype or value, or the
            probabilities have no column (VERIFY-VALID-1); the message names it.
        TypeError: an argument that must be a tensor is not (VERIFY-VALID-1).

    Example:
        The target agrees with a one-hot drafter on token 2 (accepted), then
        puts no mass on its next draft (rejected): the residual decides.

        >>> q = torch.eye(3)[[2, 0]][None]                    # drafts 2, then 0
        >>> p = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1 / 3] * 3]])
        >>> out = verify_drafts(torch.tensor([[2, 0]]), q, p, torch.tensor([2]),
        ...                     temperature=torch.tensor([1.0]), seed=torch.tensor([7]))
        >>> out.tokens.tolist(), out.num_accepted.tolist()
        ([[2, 1, -1]], [1])
    """
    _check_types(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    if step is None:
        step = torch.zeros(num_draft.shape, dtype=torch.int64, device=num_draft.device)
    _check(draft_tokens, draft_probs, target_probs, num_draft, temperature, seed, step)
    batch, k = draft_tokens.shape
    device = draft_tokens.device
    dtype = compute_dtype(target_probs.dtype)
    p, q = target_probs.to(dtype), draft_probs.to(dtype)
    step = step.to(torch.int64)
    rows = torch.arange(batch, device=device)
    sampled = temperature > 0
    drafts = draft_tokens.long().clamp(0, p.shape[-1] - 1)

    # VERIFY-ACCEPT-1 / VERIFY-GREEDY-1: which drafts pass, then the accepted prefix.
    passes = torch.zeros(batch, k, dtype=torch.bool, device=device)
    for j in range(k):
        p_x = p[rows, j, drafts[:, j]]
        q_x = q[rows, j, drafts[:, j]]
        greedy_pass = drafts[:, j] == greedy(p[:, j])
        if seed is not None:
            u = uniform(seed, step + j, 1, stream=STREAM_ACCEPT, dtype=dtype)[:, 0]
            passes[:, j] = torch.where(sampled, u * q_x < p_x, greedy_pass)
        else:
            passes[:, j] = greedy_pass
    drafted = torch.arange(k, device=device)[None, :] < num_draft[:, None]
    num_accepted = (passes & drafted).long().cumprod(dim=1).sum(dim=1)

    # The token after the accepted prefix: residual at a rejection, bonus otherwise.
    position = num_accepted
    p_next = p[rows, position]
    rejected = num_accepted < num_draft
    next_token = greedy(p_next)
    if seed is not None:
        q_next = q[rows, position.clamp(max=k - 1)] if k > 0 else torch.zeros_like(p_next)
        residual = (p_next - q_next).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        at = step + position
        # Each sampled row draws only the noise it uses: a vocabulary of Philox numbers.
        for stream, weights, drawing in (
            (STREAM_RESIDUAL, residual, sampled & rejected),
            (STREAM_TOKEN_CHOICE, p_next, sampled & ~rejected),
        ):
            picked = drawing.nonzero()[:, 0]
            if len(picked):
                next_token[picked] = _gumbel_choice(
                    weights[picked], seed[picked], at[picked], stream
                )

    tokens = torch.full((batch, k + 1), -1, dtype=torch.int64, device=device)
    columns = torch.arange(k + 1, device=device)[None, :]
    tokens[:, :k] = torch.where(columns[:, :k] < num_accepted[:, None], drafts, -1)
    tokens[rows, position] = next_token
    return Verification(tokens, num_accepted)
