"""Softmax stage: temperature scaling, softmax and log-softmax of logits.

Every later stage that needs probabilities (top-p, min-p, logprobs) goes
through these functions, so their arithmetic is the project's arithmetic.

[SOFTMAX-DTYPE-1] Arithmetic is float32 for every floating-point input dtype
(float16, bfloat16 and float32 inputs are upcast, outputs are float32).
float64 inputs are computed in float64: that is how the conformance suite
evaluates the reference on already-rounded inputs.

[SOFTMAX-STABLE-1] softmax(z)_i = exp(z_i − max z) / Σ_j exp(z_j − max z),
per row (last dimension). The maximum is subtracted before exponentiating,
so no exponential overflows, every entry is in [0, 1] and a row sums to 1
within rounding, whatever the magnitude of the finite logits.

[SOFTMAX-LOG-1] log_softmax(z)_i = (z_i − max z) − ln Σ_j exp(z_j − max z);
it is computed directly, not as ln(softmax), so tiny probabilities keep
their precision instead of underflowing to −inf.

[SOFTMAX-INF-1] Entries equal to −inf (masked tokens) get probability 0 and
log-probability −inf. A row must hold at least one finite entry; rows with
NaN, +inf or only −inf are invalid and are rejected by the sampling stage
(SAMPLE-VALID-1), not given a meaning here.

[SOFTMAX-TEMP-1] Temperature scaling maps a row z with temperature T > 0 to
(z − max z) / T. This is z / T shifted by a per-row constant, which no later
stage can observe (softmax, top-k, top-p, min-p and the Gumbel-max choice are
all shift invariant); subtracting first means that no finite T, however
small, overflows: the maxima map to 0 and everything else to a finite
negative value or −inf. Rows with T == 0 (greedy) are returned as z − max z.

[SOFTMAX-VALID-1] `logits` (and `apply_temperature`'s `temperature`) must be
a `torch.Tensor`: anything else (a Python number, a list, None) raises
`TypeError` naming the argument and the type it got, for example "logits must
be a torch.Tensor, got float". The spec raises `ArgumentTypeError`, a
`TypeError` that is also a `ValueError` (as PARAM-TYPE-1's
`ParameterTypeError`), so code that reports invalid arguments by catching
`ValueError` reports it too; every stage raises it for its tensor arguments
(LOGITS-VALID-1, SAMPLE-VALID-3, ATTN-VALID-1, APPEND-VALID-1,
VERIFY-VALID-1). Logits with no vocabulary (a last dimension of size 0) raise
`ValueError` naming logits, for example "logits must have at least one column
(vocabulary size 0)": a distribution over no token does not exist.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ArgumentTypeError(TypeError, ValueError):
    """An argument that must be a tensor and is not (SOFTMAX-VALID-1).

    A `TypeError`, and a `ValueError` too, like `ParameterTypeError`.
    """


def check_tensor(name: str, value: object) -> Tensor:
    """`value` if it is a `torch.Tensor`; else `ArgumentTypeError` naming `name`.

    Example:
        >>> check_tensor("logit_bias", 1.5)
        Traceback (most recent call last):
        ...
        decodespec.spec.softmax.ArgumentTypeError: logit_bias must be a torch.Tensor, got float
    """
    if not isinstance(value, Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_vocabulary(name: str, t: Tensor) -> int:
    """The size of the last dimension of `t`, the vocabulary, if it is at least 1; else
    `ValueError` naming `name` (SOFTMAX-VALID-1).

    Example:
        >>> check_vocabulary("logits", torch.zeros(2, 0))
        Traceback (most recent call last):
        ...
        ValueError: logits must have at least one column (vocabulary size 0), got shape [2, 0]
    """
    if t.dim() == 0:
        raise ValueError(f"{name} must have a vocabulary dimension [..., vocab], got shape []")
    if t.shape[-1] == 0:
        raise ValueError(
            f"{name} must have at least one column (vocabulary size 0), got shape {list(t.shape)}"
        )
    return t.shape[-1]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the spec computes in for inputs of `dtype` (SOFTMAX-DTYPE-1)."""
    if not dtype.is_floating_point:
        raise ValueError(f"logits must have a floating-point dtype, got {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _upcast(logits: Tensor) -> Tensor:
    """Valid logits (SOFTMAX-VALID-1) in the dtype the spec computes in."""
    check_tensor("logits", logits)
    dtype = compute_dtype(logits.dtype)  # raises for non-float dtypes
    check_vocabulary("logits", logits)
    return logits.to(dtype)


def softmax(logits: Tensor) -> Tensor:
    """Probabilities of each row of `logits` (SOFTMAX-STABLE-1, SOFTMAX-INF-1).

    Args:
        logits: `[..., vocab]`, any floating dtype, vocab >= 1.

    Returns:
        `[..., vocab]` float32 (float64 for float64 input).

    Raises:
        TypeError: `logits` is not a tensor; ValueError: it has no column
            (SOFTMAX-VALID-1) or a non-floating dtype.

    Example:
        >>> softmax(torch.tensor([[0.0, 0.0, float("-inf")]]))
        tensor([[0.5000, 0.5000, 0.0000]])
    """
    z = _upcast(logits)
    shifted = z - z.amax(dim=-1, keepdim=True)
    exp = shifted.exp()
    return exp / exp.sum(dim=-1, keepdim=True)


def log_softmax(logits: Tensor) -> Tensor:
    """Log-probabilities of each row of `logits` (SOFTMAX-LOG-1, SOFTMAX-INF-1).

    Args:
        logits: `[..., vocab]`, any floating dtype, vocab >= 1.

    Returns:
        `[..., vocab]` float32 (float64 for float64 input).

    Raises:
        TypeError: `logits` is not a tensor; ValueError: it has no column
            (SOFTMAX-VALID-1) or a non-floating dtype.

    Example:
        >>> log_softmax(torch.tensor([[0.0, 0.0]]))
        tensor([[-0.6931, -0.6931]])
    """
    z = _upcast(logits)
    shifted = z - z.amax(dim=-1, keepdim=True)
    return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Scale each row by its temperature, max-subtracted (SOFTMAX-TEMP-1).

    Args:
        logits: `[batch, vocab]`, any floating dtype, vocab >= 1.
        temperature: `[batch]`, finite and >= 0; 0 marks a greedy row.

    Returns:
        `[batch, vocab]` float32 (float64 for float64 input): `(z − max z) / T`,
        and `z − max z` for rows with `T == 0`.

    Raises:
        TypeError: `logits` or `temperature` is not a tensor (SOFTMAX-VALID-1).
        ValueError: the logits have no column, or `temperature` has the wrong
            shape or a value out of range; the message names the argument.

    Example:
        >>> apply_temperature(torch.tensor([[1.0, 3.0]]), torch.tensor([0.5]))
        tensor([[-4.,  0.]])
    """
    z = _upcast(logits)
    check_tensor("temperature", temperature)
    if temperature.shape != z.shape[:1]:
        raise ValueError(
            f"temperature must have shape [{z.shape[0]}] (one per row), "
            f"got {list(temperature.shape)}"
        )
    t = temperature.to(device=z.device, dtype=z.dtype)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"temperature must be finite and >= 0, got {t.tolist()}")
    shifted = z - z.amax(dim=-1, keepdim=True)
    divisor = torch.where(t > 0, t, torch.ones_like(t))
    return shifted / divisor[:, None]
