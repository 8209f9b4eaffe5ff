"""The sampling parameters evaluated by hand: an oracle independent of `sampling_tensors`.

The spec's loop, the engine and the slow loops of the tests all turn a
`SamplingParams` into per-row tensors with the same function
(`decodespec.spec.params.sampling_tensors`) and then run the same processors
on them. A bug in that step (a parameter dropped, two parameters swapped, a
bias put on the wrong token, min_tokens ignored) is invisible to a comparison
of any two of them. This module computes what a request's parameters do to
one row of logits directly from the clauses, in plain Python floats (float64)
and loops, from the parameters, the prompt and the output so far:

1. logit bias (LOGITS-BIAS-1);
2. min_tokens: the stop ids (EOS ids unless ignore_eos, and stop_token_ids)
   get −inf while fewer than min_tokens tokens were generated (LOGITS-MINTOK-1);
3. repetition penalty over the tokens of the prompt and the output, each once
   (LOGITS-REP-1); frequency penalty times the output count (LOGITS-FREQ-1);
   presence penalty once per token present in the output (LOGITS-PRES-1); in
   this order (LOGITS-ORDER-1);
4. greedy (temperature 0): the row shifted by its maximum, unfiltered
   (SAMPLE-GREEDY-1, as `process_logits` returns a greedy row);
5. temperature: `(z − max z) / T` (SOFTMAX-TEMP-1);
6. top-k, top-p, min-p, in this order, each on what the previous kept
   (SAMPLE-ORDER-1, SAMPLE-TOPK-1/2, SAMPLE-TOPP-1/2, SAMPLE-MINP-1);
7. the choice: `argmax (z + G)` with Gumbel noise from Philox4x32-10 keyed by
   the seed at step `len(output)` (SAMPLE-CHOICE-1, SAMPLE-RNG-1, SAMPLE-RNG-2),
   the generator written here again in plain integers.

Float parameters become float32 tensors (PARAM-TENSOR-1), so the oracle rounds
each one to float32 first and computes in float64 from there; on float64
logits its values are then those of the spec's arithmetic, operation for
operation.

Independence: this module imports no part of the code it judges. It reads the
fields of a `SamplingParams` and nothing else of `decodespec` (not
`sampling_tensors`, `SamplingParams.stop_ids`, `seed_to_int64`, the logits,
softmax, sampling or rng modules); tests/test_oracle_independence.py enforces
that.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

NEG_INF = -math.inf
# A filter's statistic this close to its threshold may be decided either way by an
# implementation that sums in another order (float64 rounding is ~1e-16 here).
NEAR = 1e-9


class OracleInvalidRow(ValueError):
    """The processed row is invalid (SAMPLE-VALID-1): NaN, +inf, or all −inf."""


def float32(x: float) -> float:
    """x rounded to the nearest float32, as a Python float (PARAM-TENSOR-1)."""
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def stop_token_ids(params, eos_token_ids: Iterable[int]) -> set[int]:
    """The ids min_tokens holds back: EOS ids unless ignore_eos, and the user's stop ids."""
    ids = set() if params.ignore_eos else {int(i) for i in eos_token_ids}
    return ids | {int(i) for i in params.stop_token_ids}


def apply_processors(
    params,
    logits: Sequence[float],
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Iterable[int] = (),
) -> list[float]:
    """Steps 1-3: bias, min_tokens, repetition, frequency, presence (LOGITS-ORDER-1)."""
    z = [float(x) for x in logits]
    # LOGITS-BIAS-1: z_i + b_i for each biased id.
    for token_id, bias in params.logit_bias.items():
        z[token_id] = z[token_id] + float32(bias)
    # LOGITS-MINTOK-1: while step < min_tokens, every stop id gets + (−inf).
    if len(output) < params.min_tokens:
        for token_id in stop_token_ids(params, eos_token_ids):
            z[token_id] = z[token_id] + NEG_INF
    # LOGITS-REP-1: each token of prompt ∪ output once: divide if positive, else multiply.
    theta = float32(params.repetition_penalty)
    for token_id in sorted(set(prompt) | set(output)):
        z[token_id] = z[token_id] / theta if z[token_id] > 0 else z[token_id] * theta
    counts = Counter(output)
    # LOGITS-FREQ-1: minus α_f times the count in the output (never the prompt).
    alpha_f = float32(params.frequency_penalty)
    for token_id, count in counts.items():
        z[token_id] = z[token_id] - alpha_f * count
    # LOGITS-PRES-1: minus α_p once for each token present in the output.
    alpha_p = float32(params.presence_penalty)
    for token_id in counts:
        z[token_id] = z[token_id] - alpha_p
    return z


def check_valid(z: Sequence[float]) -> None:
    """SAMPLE-VALID-1 on a processed row."""
    if any(math.isnan(x) or x == math.inf for x in z) or all(x == NEG_INF for x in z):
        raise OracleInvalidRow(f"invalid processed row: {list(z)}")


@dataclass
class Row:
    """A processed row (steps 1-8) and the tokens decided within rounding of a threshold."""

    values: list[float]
    near: dict[int, str] = field(default_factory=dict)  # token -> the filter, and how near
    greedy: bool = False


def top_k_keeps(z: Sequence[float], kept: list[bool], k: int) -> list[bool]:
    """SAMPLE-TOPK-1/2: keep i iff fewer than k tokens are strictly above it (ties kept)."""
    if k == 0:
        return kept
    return [
        kept[i] and sum(1 for zj in z if zj > z[i]) < k  # −inf entries are never above
        for i in range(len(z))
    ]


def top_p_keeps(z: Sequence[float], kept: list[bool], p: float, near: dict[int, str]) -> list[bool]:
    """SAMPLE-TOPP-1/2: with π the softmax over the kept tokens, keep i iff the mass of
    the kept tokens strictly above it is < p; p = 1 keeps everything."""
    if p >= 1:
        return kept
    top = max(z[i] for i in range(len(z)) if kept[i])
    weights = [math.exp(z[i] - top) if kept[i] else 0.0 for i in range(len(z))]
    total = sum(weights)
    out = []
    for i in range(len(z)):
        if not kept[i]:
            out.append(False)
            continue
        mass = sum(weights[j] for j in range(len(z)) if kept[j] and z[j] > z[i]) / total
        if abs(mass - p) <= NEAR:
            near[i] = f"top-p: mass above {mass!r} vs p {p!r}"
        out.append(mass < p)
    return out


def min_p_keeps(z: Sequence[float], kept: list[bool], m: float, near: dict[int, str]) -> list[bool]:
    """SAMPLE-MINP-1: keep i iff z_i >= z_max + ln m; m = 0 keeps everything."""
    if m == 0:
        return kept
    top = max(z[i] for i in range(len(z)) if kept[i])
    threshold = top + math.log(m)
    out = []
    for i in range(len(z)):
        if kept[i] and abs(z[i] - threshold) <= NEAR * max(1.0, abs(threshold)):
            near[i] = f"min-p: logit {z[i]!r} vs threshold {threshold!r}"
        out.append(kept[i] and z[i] >= threshold)
    return out


def processed(
    params,
    logits: Sequence[float],
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Iterable[int] = (),
) -> Row:
    """The row the token is drawn from (steps 1-8), as `process_logits` returns it:
    a greedy row processed and shifted by its maximum; a sampled row scaled and
    filtered, removed tokens at −inf.

    Raises:
        OracleInvalidRow: the processors leave the row invalid (SAMPLE-VALID-1).
    """
    z = apply_processors(params, logits, prompt=prompt, output=output, eos_token_ids=eos_token_ids)
    check_valid(z)
    top = max(z)
    temperature = float32(params.temperature)
    if temperature == 0:  # SAMPLE-GREEDY-1: no filter
        return Row([x - top for x in z], greedy=True)
    z = [(x - top) / temperature for x in z]  # SOFTMAX-TEMP-1
    near: dict[int, str] = {}
    kept = [x > NEG_INF for x in z]
    kept = top_k_keeps(z, kept, params.top_k)
    kept = top_p_keeps(z, kept, float32(params.top_p), near)
    kept = min_p_keeps(z, kept, float32(params.min_p), near)
    return Row([z[i] if kept[i] else NEG_INF for i in range(len(z))], near)


# ---------------------------------------------------------------------------
# The choice: Philox4x32-10 in plain integers, then Gumbel-max

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK = 0xFFFFFFFF


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple:
    """The Random123 Philox4x32-10 block function on Python ints (SAMPLE-RNG-1)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & _MASK, (k1 + _W1) & _MASK
        p0, p1 = _M0 * c0, _M1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK
    return c0, c1, c2, c3


def uniform(seed: int, step: int, vocab_size: int) -> list[float]:
    """U_i of SAMPLE-RNG-2 for a 64-bit seed in [0, 2^64) at a step, stream 0."""
    key = (seed & _MASK, (seed >> 32) & _MASK)
    words = [philox4x32_10((i, step & _MASK, step >> 32, 0), key)[0] for i in range(vocab_size)]
    return [(2 * (w >> 9) + 1) * 2.0**-24 for w in words]


def _first_argmax(values: Sequence[float]) -> int:
    best = max(values)
    return next(i for i, v in enumerate(values) if v == best)


def choose(
    params,
    logits: Sequence[float],
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Iterable[int] = (),
) -> int:
    """The token `sample` draws: greedy's smallest argmax, or Gumbel-max over the
    kept tokens with the noise of the request's seed at step len(output)."""
    row = processed(params, logits, prompt=prompt, output=output, eos_token_ids=eos_token_ids)
    if row.greedy:
        return _first_argmax(row.values)
    if params.seed is None:
        raise ValueError("a sampled row needs a seed")
    noise = [-math.log(-math.log(u)) for u in uniform(params.seed, len(output), len(logits))]
    return _first_argmax([z + g for z, g in zip(row.values, noise, strict=True)])
