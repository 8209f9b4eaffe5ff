"""Independent float64 evaluation of the sampling definitions, with rounding margins.

The spec decides every token exactly, but an implementation that computes in
float32 (in another summation order, with another `log`) can legitimately
decide a token whose deciding statistic lies within rounding of its
threshold either way. These helpers compute, from the definitions in
SEMANTICS.md and in float64, two kept sets per filter:

- `strict`: kept even if every statistic moved by the margin against it;
- `loose`: kept if some statistic moved by the margin in its favour.

An implementation conforms when its kept set lies between the two (and its
chosen token is in `loose` and scores within the margin of the best token of
`strict`). With margin 0 both sets are the definition itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = -math.inf


@dataclass
class Kept:
    strict: Tensor  # [batch, vocab] bool
    loose: Tensor  # [batch, vocab] bool


def _count_above(values: Tensor, thresholds: Tensor) -> Tensor:
    """#{j : values_j > thresholds_i} for every i, per row."""
    ascending = values.sort(dim=-1).values
    return values.shape[-1] - torch.searchsorted(ascending, thresholds.contiguous(), right=True)


def _mass_above(values: Tensor, weights: Tensor, thresholds: Tensor) -> Tensor:
    """Σ_{j : values_j > thresholds_i} weights_j for every i, per row (float64)."""
    ascending, order = values.sort(dim=-1)
    weights = weights.gather(-1, order)
    suffix = weights.flip(-1).cumsum(-1).flip(-1)  # suffix[j] = Σ_{l >= j} weights[l]
    suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], dim=-1)
    first_above = torch.searchsorted(ascending, thresholds.contiguous(), right=True)
    return suffix.gather(-1, first_above)


def top_k(scaled: Tensor, k: Tensor, rel: float) -> Kept:
    """top-k: keep i iff #{j : z_j > z_i} < k; the margin blurs each z_i by rel·max(1, |z_i|)."""
    z = scaled.double()
    finite = z > NEG_INF
    tol = rel * z.abs().clamp(min=1).masked_fill(~finite, 0)
    k = k.to(torch.int64)[:, None]
    off = k == 0
    strict = (off | (_count_above(z, z - tol) < k)) & finite
    loose = (off | (_count_above(z, z + tol) < k)) & finite
    return Kept(strict, loose)


def top_p(scaled: Tensor, allowed: Tensor, p: Tensor, rel: float, mass_margin: float) -> Kept:
    """top-p over the tokens in `allowed`: keep i iff Σ_{j : z_j > z_i} π_j < p.

    Each z_i is blurred by rel·max(1, |z_i|), each mass by `mass_margin`.
    """
    z = scaled.double().masked_fill(~allowed, NEG_INF)
    probs = torch.softmax(z, dim=-1)
    p = p.double()[:, None]
    tol = rel * z.abs().clamp(min=1).masked_fill(~allowed, 0)
    low = _mass_above(z, probs, z + tol)  # fewest tokens counted above
    high = _mass_above(z, probs, z - tol)  # most tokens counted above
    off = p >= 1
    strict = (off | (high + mass_margin < p)) & allowed
    loose = (off | (low - mass_margin < p)) & allowed
    return Kept(strict, loose)


def min_p(scaled: Tensor, allowed: Tensor, m: Tensor, rel: float) -> Kept:
    """min-p: keep i iff z_i >= z_max + ln m (± rel·max(1, |threshold|))."""
    z = scaled.double().masked_fill(~allowed, NEG_INF)
    threshold = z.amax(dim=-1, keepdim=True) + m.double()[:, None].log()
    tol = rel * threshold.abs().clamp(min=1).nan_to_num(posinf=0.0, neginf=0.0)
    strict = (z >= threshold + tol) & allowed
    loose = (z >= threshold - tol) & allowed
    return Kept(strict, loose)


def chain(
    scaled: Tensor, k: Tensor, p: Tensor, m: Tensor, *, rel: float, mass_margin: float
) -> Kept:
    """top-k, then top-p on what top-k kept, then min-p, each with its margin.

    The strict chain feeds strict sets forward, the loose chain loose sets.
    """
    kk = top_k(scaled, k, rel)
    strict_p = top_p(scaled, kk.strict, p, rel, mass_margin).strict
    loose_p = top_p(scaled, kk.loose, p, rel, mass_margin).loose
    strict = min_p(scaled, strict_p, m, rel).strict
    loose = min_p(scaled, loose_p, m, rel).loose
    return Kept(strict, loose)


def assert_between(mask: Tensor, kept: Kept, what: str) -> None:
    """The implementation's kept set lies between strict and loose."""
    mask = mask.cpu()
    strict, loose = kept.strict.cpu(), kept.loose.cpu()
    missing = strict & ~mask
    extra = mask & ~loose
    if bool(missing.any()) or bool(extra.any()):
        raise AssertionError(
            f"{what}: kept set differs from the definition beyond rounding: "
            f"dropped {missing.nonzero().tolist()} (row, token) that must be kept, "
            f"kept {extra.nonzero().tolist()} that must be dropped"
        )
