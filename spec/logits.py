"""Logits stage: from hidden states to logits, then the logit processors.

The processors are written over dense per-row tensors (`[batch, vocab]`
masks and counts, `[batch]` parameters), so one call serves a whole batch
whose requests have different parameters, and so that a kernel can fuse
them into the sampling pass.

[LOGITS-PROJ-1] The logits of a position are its final hidden state times
the transposed output projection, `z = h Wᵀ` (`W` is `[vocab, hidden]`, the
embedding matrix when the model ties them), accumulated and returned in
float32 (float64 for float64 inputs). Only the positions being sampled, the
last of each sequence, are projected.

[LOGITS-BIAS-1] Logit bias adds a per-row, per-token value: `z_i ← z_i + b_i`,
with `b_i` in [-100, 100] (0 for tokens without a bias).

[LOGITS-MINTOK-1] While a request has produced fewer than `min_tokens`
tokens (`step < min_tokens`), every one of its stop token ids `s` (EOS ids
and user stop ids) gets `z_s ← z_s + (−inf)`. Adding −inf rather than
assigning it keeps a NaN logit NaN, so masking never hides an invalid row.

[LOGITS-REP-1] The repetition penalty θ > 0 applies to every token present
in the prompt or in the output so far (each such token once, however often
it occurs): `z_i ← z_i / θ` if `z_i > 0`, else `z_i ← z_i · θ`. θ > 1
discourages repetition whatever the sign of the logit; θ = 1 is the
identity.

[LOGITS-FREQ-1] The frequency penalty α_f in [-2, 2] subtracts the token's
count in the output so far (not the prompt): `z_i ← z_i − α_f · c_i`.

[LOGITS-PRES-1] The presence penalty α_p in [-2, 2] subtracts once for every
token present in the output so far: `z_i ← z_i − α_p · [c_i > 0]`.

[LOGITS-ORDER-1] The processors run in this order: logit bias, min_tokens
masking, repetition, frequency, presence. Each one sees the previous one's
output (the repetition penalty divides the biased logit).

[LOGITS-VALID-1] Every tensor argument of `compute_logits` and of the
processors must be a `torch.Tensor`: anything else (a Python number, a list,
None) raises `TypeError` naming the argument and the type it got, for example
"logit_bias must be a torch.Tensor, got float" (the spec raises
`ArgumentTypeError`, a `TypeError` that is also a `ValueError`,
SOFTMAX-VALID-1). A wrong shape raises `ValueError` naming the argument.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .softmax import check_tensor, compute_dtype


def compute_logits(hidden_states: Tensor, output_weight: Tensor) -> Tensor:
    """Project final hidden states to logits (LOGITS-PROJ-1).

    Args:
        hidden_states: `[num_rows, hidden]`, the final (normed) hidden state of
            each position to sample; any floating dtype.
        output_weight: `[vocab, hidden]`, the output projection.

    Returns:
        `[num_rows, vocab]` float32 logits (float64 if either input is float64).

    Example:
        >>> compute_logits(torch.ones(1, 2), torch.tensor([[1.0, 2.0], [0.5, 0.5]]))
        tensor([[3., 1.]])
    """
    check_tensor("hidden_states", hidden_states)
    check_tensor("output_weight", output_weight)
    if hidden_states.dim() != 2 or output_weight.dim() != 2:
        raise ValueError(
            "hidden_states must be [num_rows, hidden] and output_weight [vocab, hidden], "
            f"got {list(hidden_states.shape)} and {list(output_weight.shape)}"
        )
    if hidden_states.shape[1] != output_weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden_states has {hidden_states.shape[1]}, "
            f"output_weight has {output_weight.shape[1]}"
        )
    dtype = torch.promote_types(
        compute_dtype(hidden_states.dtype), compute_dtype(output_weight.dtype)
    )
    return hidden_states.to(dtype) @ output_weight.to(dtype).T


def _rows(name: str, tensor: Tensor, batch: int, vocab: int | None = None) -> None:
    check_tensor(name, tensor)
    shape = [batch] if vocab is None else [batch, vocab]
    if list(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {list(tensor.shape)}")


def _check_logits(logits: Tensor) -> tuple[int, int]:
    """LOGITS-VALID-1 for the processors' logits: a `[batch, vocab]` tensor."""
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    return logits.shape[0], logits.shape[1]


def apply_logit_bias(logits: Tensor, logit_bias: Tensor) -> Tensor:
    """Add a dense per-row bias (LOGITS-BIAS-1).

    Args:
        logits: `[batch, vocab]` float32 (or float64).
        logit_bias: `[batch, vocab]`, values in [-100, 100].

    Example:
        >>> apply_logit_bias(torch.zeros(1, 2), torch.tensor([[0.0, -100.0]]))
        tensor([[   0., -100.]])
    """
    _check_logits(logits)
    _rows("logit_bias", logit_bias, *logits.shape)
    return logits + logit_bias.to(logits.dtype)


def apply_min_tokens(
    logits: Tensor, stop_token_mask: Tensor, min_tokens: Tensor, step: Tensor
) -> Tensor:
    """Ban stop tokens while a request is shorter than min_tokens (LOGITS-MINTOK-1).

    Args:
        logits: `[batch, vocab]` float32 (or float64).
        stop_token_mask: `[batch, vocab]` bool, True at the row's stop ids.
        min_tokens: `[batch]` int, the row's minimum number of output tokens.
        step: `[batch]` int, the number of tokens the row has produced so far.

    Example:
        >>> apply_min_tokens(torch.zeros(1, 2), torch.tensor([[False, True]]),
        ...                  torch.tensor([1]), torch.tensor([0]))
        tensor([[0., -inf]])
    """
    batch, vocab = _check_logits(logits)
    _rows("stop_token_mask", stop_token_mask, batch, vocab)
    _rows("min_tokens", min_tokens, batch)
    _rows("step", step, batch)
    banned = stop_token_mask & (step < min_tokens)[:, None]
    return logits + torch.where(banned, float("-inf"), 0.0).to(logits.dtype)


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
) -> Tensor:
    """Repetition, then frequency, then presence penalty (LOGITS-REP-1, -FREQ-1, -PRES-1).

    Args:
        logits: `[batch, vocab]` float32 (or float64).
        prompt_mask: `[batch, vocab]` bool, True for tokens in the row's prompt.
        output_counts: `[batch, vocab]` int, how often each token occurs in
            the row's output so far.
        repetition_penalty: `[batch]`, > 0 (1 disables).
        frequency_penalty: `[batch]`, in [-2, 2] (0 disables).
        presence_penalty: `[batch]`, in [-2, 2] (0 disables).

    Example:
        >>> apply_penalties(torch.tensor([[2.0, -2.0, 2.0]]),
        ...                 torch.tensor([[True, True, False]]), torch.tensor([[0, 0, 3]]),
        ...                 torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([1.0]))
        tensor([[ 1.0000, -4.0000, -1.5000]])
    """
    batch, vocab = _check_logits(logits)
    _rows("prompt_mask", prompt_mask, batch, vocab)
    _rows("output_counts", output_counts, batch, vocab)
    for name, value in (
        ("repetition_penalty", repetition_penalty),
        ("frequency_penalty", frequency_penalty),
        ("presence_penalty", presence_penalty),
    ):
        _rows(name, value, batch)
    dtype = logits.dtype
    theta = repetition_penalty.to(dtype)[:, None]
    counts = output_counts.to(dtype)
    seen = prompt_mask | (output_counts > 0)
    penalized = torch.where(logits > 0, logits / theta, logits * theta)
    z = torch.where(seen, penalized, logits)
    z = z - frequency_penalty.to(dtype)[:, None] * counts
    return z - presence_penalty.to(dtype)[:, None] * (counts > 0).to(dtype)


def apply_logit_processors(
    logits: Tensor,
    *,
    step: Tensor,
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
) -> Tensor:
    """All processors in the spec's order (LOGITS-ORDER-1); None disables one.

    The min_tokens processor needs `stop_token_mask` and `min_tokens`; the
    penalties need `prompt_mask`, `output_counts` and all three penalty
    tensors. Returns float32 `[batch, vocab]` (float64 for float64 input).
    """
    _check_logits(logits)
    z = logits.to(compute_dtype(logits.dtype))
    if logit_bias is not None:
        z = apply_logit_bias(z, logit_bias)
    if (stop_token_mask is None) != (min_tokens is None):
        raise ValueError("stop_token_mask and min_tokens must be given together")
    if stop_token_mask is not None and min_tokens is not None:
        z = apply_min_tokens(z, stop_token_mask, min_tokens, step)
    penalty_inputs = (
        prompt_mask,
        output_counts,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
    )
    given = [t is not None for t in penalty_inputs]
    if any(given) and not all(given):
        raise ValueError(
            "prompt_mask, output_counts, repetition_penalty, frequency_penalty and "
            "presence_penalty must be given together"
        )
    if all(given):
        z = apply_penalties(z, *penalty_inputs)  # type: ignore[arg-type]
    return z
