"""Sampling in Triton: from logits to tokens in one fused, sort-free launch per row.

Same names, signatures and semantics as `decodespec.spec.sampling.sample`,
`process_logits`, `greedy`, the three filter masks and `uniform` (SAMPLE-*,
LOGITS-*); logprobs have their own kernel (`logprobs.py`).
One program owns one row and walks its vocabulary `BLOCK_V` entries at a
time:

1. the grammar's token mask (MASK-SAMPLE-1), then the processors (bias,
   min_tokens, repetition / frequency / presence), in the spec's order and
   in float32 (no fused multiply-add: the launch disables
   FP fusion so each step rounds as PyTorch does); validity; the maximum and
   its first index; the normaliser `Z = Σ exp((z − max z) / T)`, online (each
   chunk's sum added to the running one rescaled to the new maximum). The
   processed row goes to a float32 scratch row. A row that draws a token and
   filters (top-k, top-p or min-p) also keeps, in index order, the *candidates*:
   the tokens at or above a running bound under which no token the filters
   keep can lie (counts and masses at 16 fixed values of s, −j²/8 down to −32,
   kept as lower bounds while the maximum grows; `_streamed_bound`).
2. greedy rows stop here. Sampled rows are scaled, `s = (z − max z) / T`
   (correctly rounded division), so the maximum is exactly 0 and every other
   value is negative or −inf.
3. thresholds, found by searching the *value* domain, never by sorting. A
   float32 maps to an int32 key that orders like the floats; the search keeps
   an interval of keys and, per pass, evaluates `NUM_PIVOTS` pivots at once,
   so 32 bits take about 8 passes — over the candidates, a few dozen tokens:
   - top-k: the largest key v with `#{s ≥ v} ≥ k` (the k-th largest value);
     a token is kept iff its key is ≥ v, ties at the boundary included;
   - top-p: the smallest key v with `Σ_{kept s > v} exp(s) < p · Z`, Z the
     mass top-k kept (top-p alone: pass 1's normaliser); a token is kept iff
     its key is ≥ v, so the crossing token and its ties stay;
   - min-p: `ln m` directly (`s_max = 0`).
   Every token pass 1 left lies at or below its final bound, so a threshold
   found over the candidates above the bound is the row's, and one at or below
   it is the row's or lower: the candidates give the row's answer when the
   largest threshold clears the bound (and top-k's does, with top-p, whose mass
   is what top-k kept). Where not (top-p alone's bound is a guess that later
   chunks can break), a pass over the scratch row bounds it exactly and a
   second compacts again; where even that bound fails, the searches walk the
   row: the same thresholds on every path.
4. one more pass (over the candidates, when there are) draws `argmax(s + G)`
   over the kept tokens, with `G = −ln(−ln U)` and U from Philox4x32-10 over
   the counter `(index, step_lo, step_hi, 0)` and key `seed` (SAMPLE-RNG-2):
   the numbers are bit-identical to the spec's.

The kernel also judges the parameters' values (PARAM-RANGE-1) and writes one
error word per row (`checks.py`): invalid rows (NaN, +inf, nothing finite,
judged after the processors) and rows with a parameter out of range get token
−1. The host reads nothing on the way: absent parameters are constexpr flags,
sizes are not specialised (one compiled variant for every vocabulary and batch),
and a caller that passes `errors=` reads the words when it chooses (an engine:
once per step); otherwise the wrapper reads them once and raises
`InvalidLogitsError` or the ValueError naming the parameter.

Reads of a row, in passes over its vocabulary (tests/kernels/test_contracts_sampling.py
counts them), at temperature 0.7 on logits of standard deviation 3: greedy 1;
temperature alone 2 (the draw needs the whole row); min-p 0.05 1.0, top-k 50
1.1–1.3, top-p 0.9 1.2–1.3, top-k + top-p with or without min-p 1.3–1.5 (walking
the row: 10, 19 and 2). The worst case is a flat row, whose candidates are most
of it: on standard deviation 1, top-p alone reads 9.3 (its searches, 8 passes
each, over three quarters of the row) and top-k 1.5. A row's result depends
only on that row and its parameters (batch invariance), and every reduction has
a fixed order (the same inputs give the same tokens).

Logits must be float16, bfloat16 or float32 (float64 is the spec's
reference dtype, not a kernel one).

Why one file of some 1,000 lines: `sample`, `process_logits`, `greedy` and the
three masks are one kernel run in different modes (the fused pass above
stops at the step each needs), so its building blocks, its launch and the
checks of its arguments belong together; a downstream engine vendors it as
one unit beside `checks.py`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .checks import (
    INTERPRET,
    check_kernel_device,
    check_logits,
    check_tensor,
    error_words,
    raise_for_errors,
)
from .token_mask import allowed_tokens, check_bitmask

# The int32 key of −inf: every finite float32 has a larger key (see _ordered_key).
KEY_NEG_INF = tl.constexpr(-2139095041)
# Pivots per search pass: 16 keep the GPU's comparisons in registers (8 passes for 32
# bits). The interpreter pays per operation more than per element: small vocabularies
# take 256 pivots there (4 passes).
NUM_PIVOTS = 16
INTERPRETER_SMALL_VOCAB_PIVOTS = 256

# The bits of a row's error word (kernels/checks.py says how error words work).
ERROR_INVALID_LOGITS = tl.constexpr(1)  # NaN, +inf or nothing finite (SAMPLE-VALID-1)
ERROR_OUT_OF_RANGE = tl.constexpr(2)  # a parameter outside its range (PARAM-RANGE-1)
ERROR_NO_SEED = tl.constexpr(4)  # a sampled row and no seed
ARGUMENT_ERRORS = ERROR_OUT_OF_RANGE | ERROR_NO_SEED
# Pivots of the candidate bound (`_candidate_bound`).
BOUND_PIVOTS = tl.constexpr(16)


class InvalidLogitsError(ValueError):
    """Rows whose logits are NaN, +inf or all −inf (SAMPLE-VALID-2).

    `rows` lists them; `tokens` holds every row's token, −1 for those rows.
    """

    def __init__(self, rows: list[int], tokens: Tensor) -> None:
        super().__init__(f"invalid logits (NaN, +inf or all -inf) in rows {rows}")
        self.rows = rows
        self.tokens = tokens


# ---------------------------------------------------------------- building blocks


@triton.jit
def _ordered_key(x):
    """int32 keys that order like the float32 values `x` (NaN excluded; −0 as +0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _processed(
    logits_row,
    bitmask_row,
    words,
    bias_row,
    stop_row,
    prompt_row,
    counts_row,
    offsets,
    vocab,
    banned,
    theta,
    alpha_f,
    alpha_p,
    HAS_BITMASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MIN_TOKENS: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
):
    """The processed logits of one chunk (MASK-SAMPLE-1, LOGITS-ORDER-1), −inf past
    the vocabulary, and how many of its per-token parameters are out of range."""
    in_vocab = offsets < vocab
    out_of_range = 0
    z = tl.load(logits_row + offsets, mask=in_vocab, other=0.0).to(tl.float32)
    if HAS_BITMASK:  # the grammar's mask first, replacing whatever the logit held
        z = tl.where(allowed_tokens(bitmask_row, offsets, in_vocab, words), z, float("-inf"))
    if HAS_BIAS:
        bias = tl.load(bias_row + offsets, mask=in_vocab, other=0.0)
        out_of_range += tl.sum((~((bias >= -100.0) & (bias <= 100.0))).to(tl.int32), axis=0)
        z = z + bias.to(tl.float32)
    if HAS_MIN_TOKENS:
        stop = tl.load(stop_row + offsets, mask=in_vocab, other=0) != 0
        z = z + tl.where(stop & banned, float("-inf"), 0.0)  # adding keeps NaN NaN
    if HAS_PENALTIES:
        counts = tl.load(counts_row + offsets, mask=in_vocab, other=0)
        out_of_range += tl.sum((counts < 0).to(tl.int32), axis=0)
        in_output = counts > 0
        in_prompt = tl.load(prompt_row + offsets, mask=in_vocab, other=0) != 0
        penalized = tl.where(z > 0, tl.div_rn(z, theta), z * theta)
        z = tl.where(in_prompt | in_output, penalized, z)
        z = z - alpha_f * counts.to(tl.float32)
        z = z - alpha_p * in_output.to(tl.float32)
    return tl.where(in_vocab, z, float("-inf")), out_of_range


@triton.jit
def _scaled(scratch_row, offsets, vocab, shift, scale):
    """`(z − shift) / scale` of one chunk of the processed row: `(z − max z) / T`
    when sampling (SOFTMAX-TEMP-1), z itself (shift 0, scale 1) for the masks."""
    z = tl.load(scratch_row + offsets, mask=offsets < vocab, other=float("-inf"))
    return tl.div_rn(z - shift, scale)


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    """NUM_PIVOTS keys spread over (lo, hi], the last one hi."""
    j = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    return lo + 1 + ((hi - lo - 1) * (j + 1)) // NUM_PIVOTS


@triton.jit
def _top_k_key(
    scratch_row,
    vocab,
    shift,
    scale,
    max_key,
    k,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """The largest key v with #{finite s : key(s) >= v} >= k: the k-th largest value's key."""
    lo = k.to(tl.int64) * 0 + KEY_NEG_INF  # #{s >= −inf} = all finite tokens >= k
    hi = max_key
    while lo < hi:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        counts = tl.zeros([NUM_PIVOTS], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            s = _scaled(scratch_row, start + tl.arange(0, BLOCK_V), vocab, shift, scale)
            key = _ordered_key(s).to(tl.int64)
            at_or_above = (key[:, None] >= pivots[None, :]) & (s > float("-inf"))[:, None]
            counts += tl.sum(at_or_above.to(tl.int32), axis=0)
        enough = counts >= k
        lo = tl.max(tl.where(enough, pivots, lo), axis=0)
        hi = tl.min(tl.where(enough, hi, pivots - 1), axis=0)
    return lo


@triton.jit
def _top_p_key(
    scratch_row,
    vocab,
    shift,
    scale,
    s_max,
    min_key,
    limit,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """The smallest key v with Σ exp(s) over kept s with key(s) > v below `limit`.

    Kept: finite with key >= `min_key` (what top-k kept). `limit` is p · Z, the
    masses taken relative to the maximum `s_max` (exp(s − s_max): no overflow).
    """
    lo = min_key * 0 + KEY_NEG_INF  # everything kept lies above −inf: mass Z >= limit
    hi = _ordered_key(s_max).to(tl.int64)  # nothing lies above the maximum: mass 0 < limit
    while hi - lo > 1:
        pivots = _pivots(lo, hi, NUM_PIVOTS)
        mass = tl.zeros([NUM_PIVOTS], tl.float32)
        for start in range(0, vocab, BLOCK_V):
            s = _scaled(scratch_row, start + tl.arange(0, BLOCK_V), vocab, shift, scale)
            key = _ordered_key(s).to(tl.int64)
            weight = tl.where((s > float("-inf")) & (key >= min_key), tl.exp(s - s_max), 0.0)
            above = key[:, None] > pivots[None, :]
            mass += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
        below = mass < limit
        hi = tl.min(tl.where(below, pivots, hi), axis=0)
        lo = tl.max(tl.where(below, lo, pivots), axis=0)
    return hi


@triton.jit
def _kept_mass(scratch_row, vocab, shift, scale, s_max, min_key, BLOCK_V: tl.constexpr):
    """Z = Σ exp(s − s_max) over the finite s with key >= min_key."""
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        s = _scaled(scratch_row, start + tl.arange(0, BLOCK_V), vocab, shift, scale)
        kept = (s > float("-inf")) & (_ordered_key(s).to(tl.int64) >= min_key)
        total += tl.sum(tl.where(kept, tl.exp(s - s_max), 0.0), axis=0)
    return total


@triton.jit
def _thresholds(
    source,
    length,
    shift,
    scale,
    s_max,
    k_on,
    top_k,
    p_on,
    top_p,
    row_mass,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """(top-k's key, top-p's key) over the first `length` logits of `source`
    (SAMPLE-TOPK-1, SAMPLE-TOPP-1; SAMPLE-ORDER-1: top-p's mass is what top-k kept).
    Top-p alone takes Z = `row_mass`, pass 1's normaliser of the whole row."""
    key_k = top_k * 0 + KEY_NEG_INF
    if k_on:
        max_key = _ordered_key(s_max).to(tl.int64)
        key_k = _top_k_key(source, length, shift, scale, max_key, top_k, BLOCK_V, NUM_PIVOTS)
    key_p = key_k
    if p_on:
        limit = top_p * row_mass
        if k_on:
            limit = top_p * _kept_mass(source, length, shift, scale, s_max, key_k, BLOCK_V)
        key_p = _top_p_key(source, length, shift, scale, s_max, key_k, limit, BLOCK_V, NUM_PIVOTS)
    return key_k, key_p


@triton.jit
def _bound_pivots():
    """The fixed scaled values −j²/8 (−0.125 … −32) at which candidates are bounded."""
    j = (tl.arange(0, BOUND_PIVOTS) + 1).to(tl.float32)
    return -(j * j) * 0.125


@triton.jit
def _candidate_bound(
    scratch_row, vocab, shift, scale, s_max, k_on, top_k, top_p, row_mass, BLOCK_V: tl.constexpr
):
    """A scaled value every token top-k (or, without it, top-p) keeps is at or above,
    or −inf if none of the fixed pivots will do.

    One pass counts the tokens and their mass at or above the bound pivots. Top-k:
    the highest pivot with at least k tokens at or above it, an exact bound (the k-th
    largest value is not below it). Top-p: the highest whose mass is at least
    p · `row_mass` with a margin; the caller checks it exactly on the candidates."""
    pivots = _bound_pivots()
    counts = tl.zeros([BOUND_PIVOTS], tl.int32)
    masses = tl.zeros([BOUND_PIVOTS], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        s = _scaled(scratch_row, start + tl.arange(0, BLOCK_V), vocab, shift, scale)
        weight = tl.where(s > float("-inf"), tl.exp(s - s_max), 0.0)
        above = s[:, None] >= pivots[None, :]  # −inf is above no pivot
        counts += tl.sum(above.to(tl.int32), axis=0)
        masses += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
    enough = tl.where(k_on, counts >= top_k, masses >= top_p * row_mass * 1.001)
    return tl.max(tl.where(enough, pivots, float("-inf")), axis=0)


@triton.jit
def _compact(
    scratch_row, cand_z_row, cand_i_row, vocab, shift, scale, bound, BLOCK_V: tl.constexpr
):
    """Write the processed logit and index of every finite token whose scaled value
    is at or above `bound` to the candidate rows, in index order; their number."""
    count = 0
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        z = tl.load(scratch_row + offsets, mask=offsets < vocab, other=float("-inf"))
        s = tl.div_rn(z - shift, scale)
        keep = (s > float("-inf")) & (s >= bound)
        position = count + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(cand_z_row + position, z, mask=keep)
        tl.store(cand_i_row + position, offsets, mask=keep)
        count += tl.sum(keep.to(tl.int32), axis=0)
    return count


@triton.jit
def _streamed_bound(
    z,
    z_max_before,
    z_max,
    scale,
    counts,
    masses,
    row_mass,
    bound,
    k_req,
    top_k,
    p_req,
    top_p,
    m_req,
    log_min_p,
):
    """Pass 1's running statistics after one more chunk `z`, and its candidate bound.

    `counts` and `masses` are the tokens seen so far, and their mass, at or above the
    bound pivots relative to the running maximum `z_max` (in units of `scale`);
    `row_mass` is Σ exp((z − z_max) / scale) over them, the online normaliser (Z of
    top-p alone, SAMPLE-TOPP-1). When the maximum grows, a token counted at or above
    an old pivot is counted at the highest new pivot it still surely reaches, so
    counts and masses stay lower bounds of the true ones.

    `bound` is a logit z every token the filters keep is at or above, only ever
    raised: top-k's from the highest pivot with at least k tokens (exact, as the
    k-th largest value seen can only rise), min-p's just under `max z + T ln m`;
    top-p alone's from the highest pivot holding p + (1 − p) / 2 of the mass seen,
    a guess that later chunks could break, so the caller checks the bound exactly
    at the end. Rounding here only costs candidates, never exactness."""
    pivots = _bound_pivots()
    shift = (z_max - z_max_before) / scale  # how far the pivots moved up: ≥ 0, or NaN/inf
    if z_max > z_max_before:
        reach = (pivots[None, :] - shift) >= pivots[:, None]  # [new i, old j]
        counts = tl.max(tl.where(reach, counts[None, :], 0), axis=1)
        masses = tl.max(tl.where(reach, masses[None, :], 0.0), axis=1)
        decay = tl.where(shift < float("inf"), tl.exp(-shift), 0.0)
        masses = tl.where(masses > 0.0, masses * decay, 0.0)
        row_mass = tl.where(row_mass > 0.0, row_mass * decay, 0.0)
    s = (z - z_max) / scale
    weight = tl.where(z > float("-inf"), tl.exp(s), 0.0)
    above = s[:, None] >= pivots[None, :]
    counts += tl.sum(above.to(tl.int32), axis=0)
    masses += tl.sum(tl.where(above, weight[:, None], 0.0), axis=0)
    row_mass += tl.sum(weight, axis=0)
    enough = tl.where(k_req, counts >= top_k, masses >= (top_p + (1.0 - top_p) * 0.5) * row_mass)
    pivot = tl.max(tl.where(enough & (k_req | p_req), pivots, float("-inf")), axis=0)
    if pivot > float("-inf"):
        bound = tl.maximum(bound, z_max + scale * pivot)
    # A little below min-p's threshold, which the check wants strictly above; not with
    # top-k and top-p, where top-p's mass needs all that top-k keeps.
    if m_req & ~(k_req & p_req):
        bound = tl.maximum(bound, z_max + scale * (log_min_p - 0.015625))
    return counts, masses, row_mass, bound


@triton.jit
def _uniform(seed, step, offsets, stream):
    """U of the vocabulary indices `offsets` (SAMPLE-RNG-2), exact float32."""
    zero = tl.zeros_like(offsets).to(tl.uint32)
    step_lo = zero + (step & 0xFFFFFFFF).to(tl.uint32)
    step_hi = zero + (step >> 32).to(tl.uint32)
    counter_3 = (zero + stream).to(tl.uint32)  # stream may arrive as int64 or constexpr
    word, _, _, _ = tl.philox(seed, offsets.to(tl.uint32), step_lo, step_hi, counter_3, 10)
    return ((word >> 9) * 2 + 1).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _uniform_kernel(seed_ptr, step_ptr, out_ptr, vocab, stream, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    u = _uniform(tl.load(seed_ptr + row), tl.load(step_ptr + row), offsets, stream)
    tl.store(out_ptr + row * vocab + offsets, u.to(out_ptr.dtype.element_ty), mask=offsets < vocab)


# ---------------------------------------------------------------- the fused kernel


# The sizes and strides change with the batch's vocabulary and grammar: Triton would
# compile a variant for each value that is 1 or a multiple of 16 (a recompile in the
# middle of serving); the loads do not need the alignment.
@triton.jit(do_not_specialize=["vocab", "logits_stride", "words", "bitmask_stride"])
def _sample_kernel(
    logits_ptr,
    scratch_ptr,
    cand_z_ptr,
    cand_i_ptr,
    tokens_ptr,
    errors_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    step_ptr,
    bitmask_ptr,
    bias_ptr,
    stop_ptr,
    min_tokens_ptr,
    prompt_ptr,
    counts_ptr,
    repetition_ptr,
    frequency_ptr,
    presence_ptr,
    vocab,
    logits_stride,
    words,
    bitmask_stride,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    HAS_SEED: tl.constexpr,
    HAS_STEP: tl.constexpr,
    HAS_BITMASK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MIN_TOKENS: tl.constexpr,
    HAS_PENALTIES: tl.constexpr,
    CHOOSE: tl.constexpr,
    FILTERS_ONLY: tl.constexpr,
    CANDIDATES: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """One row: its parameters' ranges, processors, validity, greedy or scale +
    filters + Gumbel-max; the row's error word.

    CHOOSE: write the token. Otherwise (process_logits) leave the row that the
    token would be drawn from in the scratch row: filtered tokens at −inf.
    FILTERS_ONLY (the mask operations): no temperature; the filters act on the
    logits as given, which the scratch row then holds with removed tokens at −inf.
    An absent parameter (HAS_* off) takes its neutral value and is never read.
    Parameters are read in their own dtypes: each range is judged on the value as
    given (PARAM-RANGE-1), then converted as PyTorch's `.to` would.
    """
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    scratch_row = scratch_ptr + row * vocab

    # The per-row parameters and their ranges (the spec's table, _RANGES).
    in_range = True
    temperature = 1.0 if FILTERS_ONLY else 0.0  # absent: a greedy row
    if HAS_TEMPERATURE:
        given_t = tl.load(temperature_ptr + row)
        in_range &= (given_t >= 0) & (given_t < float("inf"))
        temperature = given_t.to(tl.float32)
    step = row * 0
    if HAS_STEP:
        step = tl.load(step_ptr + row).to(tl.int64)
        in_range &= step >= 0
    top_k = row * 0
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row).to(tl.int64)
        in_range &= top_k >= 0
    top_p = 1.0
    if HAS_TOP_P:
        given_p = tl.load(top_p_ptr + row)
        in_range &= (given_p > 0) & (given_p <= 1)
        top_p = given_p.to(tl.float32)
    min_p = 0.0
    if HAS_MIN_P:
        given_m = tl.load(min_p_ptr + row)
        in_range &= (given_m >= 0) & (given_m <= 1)
        min_p = given_m.to(tl.float32)
    banned = False
    if HAS_MIN_TOKENS:
        min_tokens = tl.load(min_tokens_ptr + row).to(tl.int64)
        in_range &= min_tokens >= 0
        banned = step < min_tokens
    theta = 1.0
    alpha_f = 0.0
    alpha_p = 0.0
    if HAS_PENALTIES:
        given_theta = tl.load(repetition_ptr + row)
        given_f = tl.load(frequency_ptr + row)
        given_pr = tl.load(presence_ptr + row)
        in_range &= (given_theta > 0) & (given_theta < float("inf"))
        in_range &= (given_f >= -2) & (given_f <= 2) & (given_pr >= -2) & (given_pr <= 2)
        theta = given_theta.to(tl.float32)
        alpha_f = given_f.to(tl.float32)
        alpha_p = given_pr.to(tl.float32)
    seed = row * 0
    if HAS_SEED:
        seed = tl.load(seed_ptr + row).to(tl.int64)

    # Pass 1: processed logits to the scratch row, validity, first argmax; for a
    # drawing row that filters (CANDIDATES), the tokens at or above a running bound
    # on what the filters keep, compacted in index order (`_streamed_bound`).
    bad = 0
    num_finite = 0
    out_of_range = 0
    z_max = float("-inf")
    argmax = 0
    scale = row.to(tl.float32) * 0.0 + 1.0  # (z − max z) / scale: T, or 1 for the masks
    if not FILTERS_ONLY:
        if temperature > 0.0:
            scale = scale * 0.0 + temperature
    k_req = top_k > 0  # the filters the parameters ask for (validity aside)
    p_req = row < 0
    if HAS_TOP_P:
        p_req = top_p < 1.0
    m_req = row < 0
    if HAS_MIN_P:
        m_req = min_p > 0.0
    collect = (k_req | p_req | m_req) & (temperature > 0.0)
    log_min_p = tl.log(tl.where(m_req, min_p, 1.0))
    bound_counts = tl.zeros([BOUND_PIVOTS], tl.int32)
    bound_masses = tl.zeros([BOUND_PIVOTS], tl.float32)
    row_mass = 0.0
    bound = float("-inf")
    num_candidates = 0
    cand_z_row = cand_z_ptr + row * vocab
    cand_i_row = cand_i_ptr + row * vocab
    for start in range(0, vocab, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        z, chunk_out_of_range = _processed(
            logits_row,
            bitmask_ptr + row * bitmask_stride,  # the bitmask's own rows (MASK-WIDTH-1)
            words,
            bias_ptr + row * vocab,
            stop_ptr + row * vocab,
            prompt_ptr + row * vocab,
            counts_ptr + row * vocab,
            offsets,
            vocab,
            banned,
            theta,
            alpha_f,
            alpha_p,
            HAS_BITMASK,
            HAS_BIAS,
            HAS_MIN_TOKENS,
            HAS_PENALTIES,
        )
        tl.store(scratch_row + offsets, z, mask=offsets < vocab)
        out_of_range += chunk_out_of_range
        bad += tl.sum(((z != z) | (z == float("inf"))).to(tl.int32), axis=0)
        num_finite += tl.sum((z > float("-inf")).to(tl.int32), axis=0)
        chunk_max = tl.max(z, axis=0)
        chunk_argmax = tl.min(tl.where(z == chunk_max, offsets, 2147483647), axis=0)
        argmax = tl.where(chunk_max > z_max, chunk_argmax, argmax)  # ties: the earlier chunk
        z_max_before = z_max
        z_max = tl.maximum(z_max, chunk_max)
        if HAS_TOP_P or CANDIDATES:
            bound_counts, bound_masses, row_mass, bound = _streamed_bound(
                z,
                z_max_before,
                z_max,
                scale,
                bound_counts,
                bound_masses,
                row_mass,
                bound,
                k_req,
                top_k,
                p_req,
                top_p,
                m_req,
                log_min_p,
            )
        if CANDIDATES:
            # (The interpreter's masks must be vectors: no scalar in the `&`.)
            collecting = (offsets * 0 + collect.to(tl.int32)) != 0
            keep = (z > float("-inf")) & (z >= bound) & collecting
            position = num_candidates + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(cand_z_row + position, z, mask=keep)
            tl.store(cand_i_row + position, offsets, mask=keep)
            num_candidates += tl.sum(keep.to(tl.int32), axis=0)

    error = tl.where(in_range & (out_of_range == 0), 0, ERROR_OUT_OF_RANGE)
    if CHOOSE and not HAS_SEED:
        error |= tl.where(temperature > 0.0, ERROR_NO_SEED, 0)
    error |= tl.where((bad > 0) | (num_finite == 0), ERROR_INVALID_LOGITS, 0)  # SAMPLE-VALID-1
    tl.store(errors_ptr + row, error)

    # The token slot always says what happened: −1 for a row with an error, else the
    # row's token (process_logits only reads the −1s).
    if error != 0:
        tl.store(tokens_ptr + row, -1)
    elif (temperature == 0.0) & (not FILTERS_ONLY):  # SAMPLE-GREEDY-1
        tl.store(tokens_ptr + row, argmax.to(tl.int64))
        if not CHOOSE:
            for start in range(0, vocab, BLOCK_V):
                offsets = start + tl.arange(0, BLOCK_V)
                z = tl.load(scratch_row + offsets, mask=offsets < vocab)
                tl.store(scratch_row + offsets, z - z_max, mask=offsets < vocab)
    else:
        # Thresholds (SAMPLE-ORDER-1): each a key; a token is kept iff its key is >= all.
        # Sampling scales s = (z − max z) / T, so max s = 0; the masks filter z as is.
        # (`scale` is T here, or 1 for the masks: pass 1 set it.)
        shift = z_max
        s_max = z_max * 0.0
        if FILTERS_ONLY:
            shift = z_max * 0.0
            s_max = z_max
        k_on = row < 0  # false, as a value the branches below can reassign
        if HAS_TOP_K:
            k_on = (top_k > 0) & (top_k < num_finite)
        p_on = row < 0
        if HAS_TOP_P:
            p_on = top_p < 1.0

        key_m = top_k * 0 + KEY_NEG_INF
        if HAS_MIN_P:
            if min_p > 0.0:  # SAMPLE-MINP-1: s >= max s + ln m
                key_m = _ordered_key(s_max + tl.log(min_p)).to(tl.int64)

        # The searches and the draw read `source`: the scratch row, or (CANDIDATES) the
        # tokens pass 1 kept at or above its bound, in index order. Every token it left
        # lies at or below the bound, so where the largest threshold found among them
        # lies above the bound (and top-k's, with top-p), the row's searches would find
        # the same: the candidates hold every token the filters keep. Where not (a
        # guess of top-p alone that later chunks broke), a pass bounds the row exactly
        # and compacts again; where even that fails, the searches walk the row.
        source = scratch_row
        length = vocab
        use_candidates = row < 0
        key_k = top_k * 0 + KEY_NEG_INF  # no filter: no threshold
        key_p = key_k
        if CANDIDATES:
            if collect:
                key_k, key_p = _thresholds(
                    cand_z_row, num_candidates, shift, scale, s_max, k_on, top_k, p_on,
                    top_p, row_mass, BLOCK_V, NUM_PIVOTS,
                )  # fmt: skip
                key_bound = _ordered_key(tl.div_rn(bound - shift, scale)).to(tl.int64)
                threshold = tl.maximum(tl.maximum(key_k, key_p), key_m)
                # A threshold at or below the bound over the candidates is at or below
                # it over the row too, so only the largest needs to clear it; and top-k
                # before top-p, whose mass is what top-k kept.
                use_candidates = (threshold > key_bound) & (~(k_on & p_on) | (key_k > key_bound))
                if use_candidates:
                    source = cand_z_row
                    length = num_candidates
            if ~use_candidates & (k_on | p_on):
                source = scratch_row
                length = vocab
                exact_bound = _candidate_bound(
                    scratch_row, vocab, shift, scale, s_max, k_on, top_k, top_p, row_mass,
                    BLOCK_V,
                )  # fmt: skip
                if exact_bound > float("-inf"):
                    length = _compact(
                        scratch_row, cand_z_row, cand_i_row, vocab, shift, scale,
                        exact_bound, BLOCK_V,
                    )  # fmt: skip
                    source = cand_z_row
                    use_candidates = row >= 0
                    if p_on & ~k_on:  # top-p's threshold is among them iff they hold p · Z
                        every_key = key_m * 0 + KEY_NEG_INF
                        mass = _kept_mass(source, length, shift, scale, s_max, every_key, BLOCK_V)
                        if mass < top_p * row_mass:
                            source = scratch_row
                            length = vocab
                            use_candidates = row < 0
                key_k, key_p = _thresholds(
                    source, length, shift, scale, s_max, k_on, top_k, p_on, top_p, row_mass,
                    BLOCK_V, NUM_PIVOTS,
                )  # fmt: skip
        else:
            key_k, key_p = _thresholds(
                source, length, shift, scale, s_max, k_on, top_k, p_on, top_p, row_mass,
                BLOCK_V, NUM_PIVOTS,
            )  # fmt: skip
        threshold = tl.maximum(tl.maximum(key_k, key_p), key_m)

        best = float("-inf")
        token = 0
        for start in range(0, length, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            s = _scaled(source, offsets, length, shift, scale)
            kept = (s > float("-inf")) & (_ordered_key(s).to(tl.int64) >= threshold)
            if CHOOSE:  # SAMPLE-CHOICE-1: Gumbel-max, ties to the smallest index
                # (The interpreter's masks must be vectors: no scalar in the `&`.)
                from_candidates = (offsets * 0 + use_candidates.to(tl.int32)) != 0
                in_candidates = (offsets < length) & from_candidates
                index = tl.load(cand_i_row + offsets, mask=in_candidates, other=0)
                index = tl.where(from_candidates, index, offsets)
                gumbel = -tl.log(-tl.log(_uniform(seed, step, index, 0)))
                score = tl.where(kept, s + gumbel, float("-inf"))
                chunk_best = tl.max(score, axis=0)
                chunk_token = tl.min(tl.where(score == chunk_best, index, 2147483647), axis=0)
                token = tl.where(chunk_best > best, chunk_token, token)
                best = tl.maximum(best, chunk_best)
            else:
                filtered = tl.where(kept, s, float("-inf"))
                tl.store(scratch_row + offsets, filtered, mask=offsets < vocab)
        tl.store(tokens_ptr + row, token.to(tl.int64))


# ---------------------------------------------------------------- validation

# name: (low, high, low_open, high_open), PARAM-RANGE-1: a copy of the spec's table
# (decodespec.spec.params.RANGES; kernels/ imports no spec), which tests/test_project.py
# checks against it.
_RANGES = {
    "temperature": (0, math.inf, False, True),
    "top_k": (0, math.inf, False, True),
    "top_p": (0, 1, True, False),
    "min_p": (0, 1, False, False),
    "step": (0, math.inf, False, True),
    "min_tokens": (0, math.inf, False, True),
    "output_counts": (0, math.inf, False, True),
    "logit_bias": (-100, 100, False, False),
    "repetition_penalty": (0, math.inf, True, True),
    "frequency_penalty": (-2, 2, False, False),
    "presence_penalty": (-2, 2, False, False),
}
_PER_TOKEN = {"logit_bias", "stop_token_mask", "prompt_mask", "output_counts"}
_INTEGER = {"top_k", "seed", "step", "min_tokens", "output_counts"}
_PENALTY_ARGS = (
    "prompt_mask",
    "output_counts",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def _check_range(name: str, t: Tensor, low: float, high: float, low_open: bool, high_open: bool):
    v = t.double()
    ok = (v > low if low_open else v >= low) & (v < high if high_open else v <= high)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()[0].tolist()
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    value = t[tuple(bad)].item()
    raise ValueError(f"{name}[{', '.join(map(str, bad))}] must be in {interval}, got {value!r}")


def _check_sampling_args(logits: Tensor, args: dict[str, Tensor | None]) -> None:
    """Shapes, dtypes and devices of `sample`'s arguments: what the host knows without
    reading the device. Their values are the kernel's to check (`_explain_errors`)."""
    check_logits(logits)
    batch, vocab = logits.shape
    for name, t in args.items():
        if t is None:
            continue
        check_tensor(name, t)
        if name == "token_bitmask":
            check_bitmask(logits, t, name)  # MASK-VALID-1
            continue
        shape = [batch, vocab] if name in _PER_TOKEN else [batch]
        if list(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
        if name in _INTEGER and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
    if (args.get("stop_token_mask") is None) != (args.get("min_tokens") is None):
        raise ValueError("stop_token_mask and min_tokens must be given together")
    given = [args.get(name) is not None for name in _PENALTY_ARGS]
    if any(given) and not all(given):
        raise ValueError(
            "prompt_mask, output_counts, repetition_penalty, frequency_penalty and "
            "presence_penalty must be given together"
        )


def _explain_errors(
    args: dict[str, Tensor | None], choose: bool, tokens: Tensor | None = None
) -> None:
    """Raise the error behind a launch's nonzero error words (the failing path: it reads
    the device freely). Arguments first, in the spec's order, then invalid rows."""
    for name, t in args.items():
        if t is not None and name in _RANGES:
            _check_range(name, t, *_RANGES[name])
    temperature = args.get("temperature")
    if choose and args.get("seed") is None and bool((temperature > 0).any()):
        raise ValueError("seed is required when a row has temperature > 0")
    bad = tokens < 0 if tokens is not None else None
    if bad is not None and bool(bad.any()):
        raise InvalidLogitsError(bad.nonzero().flatten().tolist(), tokens)


# ---------------------------------------------------------------- wrappers

# The dtypes the kernel reads a per-row parameter in; others are converted first.
_ROW_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
)


def _launch(
    logits: Tensor,
    args: dict[str, Tensor | None],
    choose: bool,
    filters_only: bool = False,
    errors: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Check what the host knows, launch once; (tokens, scratch rows, error words).

    No value is read on the host: an absent parameter is a constexpr flag, not a
    tensor of defaults, and the kernel judges ranges and validity itself."""
    _check_sampling_args(logits, args)
    batch, vocab = logits.shape
    device = logits.device
    words = error_words(errors, batch, device)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()

    def per_row(name: str) -> Tensor:
        t = args.get(name)
        if t is None:  # never read (its flag is off): any pointer will do
            return words
        if t.dtype not in _ROW_DTYPES:  # bool, int8, ...: exact in these
            t = t.to(torch.float32 if name not in _INTEGER else torch.int64)
        return t.contiguous()

    def per_token(name: str) -> Tensor:
        t = args.get(name)
        # An absent tensor is never read (its constexpr flag is off): any pointer will do.
        return logits if t is None else t.contiguous()

    # A bitmask of any width (MASK-WIDTH-1), read at its own row stride: a slice of
    # an engine's wider buffer, or one row broadcast to the batch, is not copied.
    bitmask = args.get("token_bitmask")
    if bitmask is not None and bitmask.shape[1] > 1 and bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()  # the words of a row side by side

    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    scratch = torch.empty(batch, vocab, dtype=torch.float32, device=device)
    if batch == 0:
        return tokens, scratch, words
    # Candidates (a bound, then the filters' searches and the draw on the few tokens
    # above it) when a row may filter and draws a token.
    candidates = (
        choose
        and not filters_only
        and any(args.get(name) is not None for name in ("top_k", "top_p", "min_p"))
    )
    cand_z = (
        torch.empty(batch, vocab, dtype=torch.float32, device=device) if candidates else scratch
    )
    cand_i = torch.empty(batch, vocab, dtype=torch.int32, device=device) if candidates else words
    _sample_kernel[(batch,)](
        logits,
        scratch,
        cand_z,
        cand_i,
        tokens,
        words,
        per_row("temperature"),
        per_row("top_k"),
        per_row("top_p"),
        per_row("min_p"),
        per_row("seed"),
        per_row("step"),
        logits if bitmask is None else bitmask,
        per_token("logit_bias"),
        per_token("stop_token_mask"),
        per_row("min_tokens"),
        per_token("prompt_mask"),
        per_token("output_counts"),
        per_row("repetition_penalty"),
        per_row("frequency_penalty"),
        per_row("presence_penalty"),
        vocab,
        logits.stride(0),
        1 if bitmask is None else bitmask.shape[1],
        0 if bitmask is None else bitmask.stride(0),
        HAS_TEMPERATURE=args.get("temperature") is not None,
        HAS_TOP_K=args.get("top_k") is not None,
        HAS_TOP_P=args.get("top_p") is not None,
        HAS_MIN_P=args.get("min_p") is not None,
        HAS_SEED=args.get("seed") is not None,
        HAS_STEP=args.get("step") is not None,
        HAS_BITMASK=bitmask is not None,
        HAS_BIAS=args.get("logit_bias") is not None,
        HAS_MIN_TOKENS=args.get("stop_token_mask") is not None,
        HAS_PENALTIES=args.get("prompt_mask") is not None,
        CHOOSE=choose,
        FILTERS_ONLY=filters_only,
        CANDIDATES=candidates,
        # One chunk per row in the interpreter (its cost is per step); on a GPU
        # chunks small enough that the pivot comparisons stay in registers.
        BLOCK_V=min(triton.next_power_of_2(vocab), 4096 if INTERPRET else 1024),
        NUM_PIVOTS=INTERPRETER_SMALL_VOCAB_PIVOTS if INTERPRET and vocab <= 1024 else NUM_PIVOTS,
        num_warps=4,
        # Each processor and the scaling round separately, as PyTorch does.
        enable_fp_fusion=False,
    )
    return tokens, scratch, words


def greedy(logits: Tensor) -> Tensor:
    """`[batch]` int64: the smallest index of each row's maximum (SAMPLE-GREEDY-1).

    Rows with NaN, +inf or nothing finite have no maximum in the spec's sense
    (SAMPLE-VALID-1): their token is −1.

    Example:
        >>> greedy(torch.tensor([[1.0, 3.0, 3.0, 2.0]]))
        tensor([1])
    """
    check_logits(logits)
    # No temperature: every row greedy. Its invalid rows say so by their −1 tokens, so
    # the words are scratch nobody reads (not cleared).
    unread = torch.empty(logits.shape[0], dtype=torch.int32, device=logits.device)
    tokens, _, _ = _launch(logits, {}, choose=True, errors=unread)
    return tokens


def _filter_mask(logits: Tensor, name: str, values: Tensor) -> Tensor:
    """The tokens one filter keeps of the logits as given (no temperature, no processors).
    One read of the error words: a value out of range raises; an invalid row keeps
    nothing, as its −inf scratch row says."""
    check_logits(logits)
    check_tensor(name, values)
    args = {name: values}
    _, filtered, words = _launch(logits, args, choose=False, filters_only=True)
    raise_for_errors(words & ARGUMENT_ERRORS.value, lambda: _explain_errors(args, choose=False))
    return filtered > float("-inf")


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens top-k keeps (SAMPLE-TOPK-1, SAMPLE-TOPK-2).

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32; −inf entries are masked.
        top_k: `[batch]` int, >= 0; 0 keeps every finite token.

    Example:
        >>> top_k_mask(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), torch.tensor([2]))
        tensor([[ True, False,  True,  True]])
    """
    return _filter_mask(logits, "top_k", top_k)


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens top-p keeps (SAMPLE-TOPP-1, SAMPLE-TOPP-2).

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32; −inf entries are
            masked (π is the softmax over the rest).
        top_p: `[batch]`, in (0, 1]; 1 keeps every finite token.

    Example:
        >>> top_p_mask(torch.tensor([[2.0, 1.0, 1.0, 0.0]]).log(), torch.tensor([0.5]))
        tensor([[ True, False, False, False]])
    """
    return _filter_mask(logits, "top_p", top_p)


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens min-p keeps (SAMPLE-MINP-1).

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32; −inf entries are masked.
        min_p: `[batch]`, in [0, 1]; 0 keeps every finite token.

    Example:
        >>> min_p_mask(torch.tensor([[4.0, 2.0, 1.0]]).log(), torch.tensor([0.5]))
        tensor([[ True,  True, False]])
    """
    return _filter_mask(logits, "min_p", min_p)


def uniform(
    seed: Tensor,
    step: Tensor,
    vocab_size: int,
    stream: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`[batch, vocab_size]` uniform numbers of each row, bit-identical to the spec's.

    (SAMPLE-RNG-1, SAMPLE-RNG-2, SAMPLE-RNG-3.) Philox4x32-10 with key `seed`
    and counter `(index, step_lo, step_hi, stream)`; `U = (2·⌊w / 2^9⌋ + 1) / 2^24`.

    Args:
        seed: `[batch]` int64, the bit pattern of each row's 64-bit seed.
        step: `[batch]` int64 >= 0, tokens the row has generated so far.
        vocab_size: number of vocabulary indices, >= 0.
        stream: which independent stream, in [0, 2^32) (0: token choice).
        dtype: float32 or float64 (the values are exact in both).

    Example:
        >>> uniform(torch.tensor([0]), torch.tensor([0]), 2)
        tensor([[0.3990, 0.9722]])
    """
    for name, t in (("seed", seed), ("step", step)):
        check_tensor(name, t)
        if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a [batch] int32/int64 tensor, got {t!r}")
        check_kernel_device(name, t)
    if step.shape != seed.shape or step.device != seed.device:
        raise ValueError(f"step must match seed's shape {list(seed.shape)} and device")
    if bool((step < 0).any()):
        raise ValueError(f"step must be >= 0, got {step.tolist()}")
    if not isinstance(vocab_size, int) or vocab_size < 0:
        raise ValueError(f"vocab_size must be an int >= 0, got {vocab_size!r}")
    if not isinstance(stream, int) or not 0 <= stream < 2**32:
        raise ValueError(f"stream must be an int in [0, 2^32), got {stream!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    out = torch.empty(seed.shape[0], vocab_size, dtype=dtype, device=seed.device)
    if out.numel() == 0:
        return out
    block = min(triton.next_power_of_2(vocab_size), 1024)
    _uniform_kernel[(seed.shape[0], triton.cdiv(vocab_size, block))](
        seed.to(torch.int64), step.to(torch.int64), out, vocab_size, stream, BLOCK_V=block
    )
    return out


def sample(
    logits: Tensor,
    *,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    seed: Tensor | None = None,
    step: Tensor | None = None,
    token_bitmask: Tensor | None = None,
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
    errors: Tensor | None = None,
) -> Tensor:
    """Draw one token per row, the whole pipeline in one launch (spec.sampling.sample).

    Args:
        logits: `[batch, vocab]` float16, bfloat16 or float32, any vocabulary size >= 1.
        temperature: `[batch]` float, finite and >= 0; 0 makes the row greedy.
        top_k: `[batch]` int >= 0 (0: off).
        top_p: `[batch]` float in (0, 1] (1: off).
        min_p: `[batch]` float in [0, 1] (0: off).
        seed: `[batch]` int64 bit patterns of 64-bit seeds; required when a row
            has temperature > 0.
        step: `[batch]` int64 >= 0, tokens the row has generated (default 0).
        token_bitmask: `[batch, words]` int32 grammar masks (MASK-SAMPLE-1),
            applied first in the same pass; a row of −1 words allows every token.
            Any `words >= 1` and any strides (MASK-WIDTH-1): bits past `vocab` are
            ignored, tokens past `32 · words` disallowed.
        logit_bias: `[batch, vocab]` float in [-100, 100].
        stop_token_mask: `[batch, vocab]` bool, with `min_tokens` `[batch]` int.
        prompt_mask: `[batch, vocab]` bool, with `output_counts` `[batch,
            vocab]` int and the three `[batch]` penalties.
        errors: `[batch]` int32, written with each row's error word (0: fine;
            `ERROR_INVALID_LOGITS`, `ERROR_OUT_OF_RANGE`, `ERROR_NO_SEED`), which
            the caller reads when it chooses: nothing is raised for values, and
            a row with an error gets token −1. Omitted: the wrapper reads the
            words once and raises.

    Returns:
        `[batch]` int64 tokens: the spec's, except where two candidates'
        scores (or a token's statistic and its threshold) are within float32
        rounding of each other.

    Raises:
        InvalidLogitsError: some rows are invalid; `.rows` names them and
            `.tokens` holds the other rows' tokens (−1 for those rows).
        ValueError: an argument has the wrong shape, dtype, device or range, or
            the logits have no column (SAMPLE-VALID-3); with `errors` given, only
            what the host knows (shape, dtype, device) raises.
        TypeError: an argument that must be a tensor is not (SAMPLE-VALID-3).

    Cost (tests/kernels/test_contracts_sampling.py): one launch; with `errors`
    given, no host sync and no PyTorch operation besides allocating the tokens,
    the scratch rows and (omitted) the words; without it, one host sync.

    Example:
        >>> logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
        >>> sample(logits, temperature=torch.tensor([0.0, 1.0]), top_k=torch.tensor([0, 1]),
        ...        seed=torch.tensor([0, 42]))
        tensor([1, 1])
    """
    check_tensor("temperature", temperature)
    args = dict(locals())
    del args["logits"], args["errors"]
    tokens, _, words = _launch(logits, args, choose=True, errors=errors)
    if errors is None:
        raise_for_errors(words, lambda: _explain_errors(args, choose=True, tokens=tokens))
    return tokens


def process_logits(
    logits: Tensor,
    *,
    temperature: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    min_p: Tensor | None = None,
    step: Tensor | None = None,
    token_bitmask: Tensor | None = None,
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
    errors: Tensor | None = None,
) -> Tensor:
    """The logits the token is drawn from (spec.sampling.process_logits).

    Same arguments as `sample` (`errors` included) without the seed; a row with an
    error word comes back unspecified. Sampled rows come back scaled
    and filtered (removed tokens at −inf), greedy rows processed and shifted by
    their maximum.

    Returns:
        `[batch, vocab]` float32.

    Raises:
        InvalidLogitsError: some rows are invalid (`.tokens` is all −1).
        ValueError: an argument has the wrong shape, dtype, device or range, or
            the logits have no column (SAMPLE-VALID-3).
        TypeError: an argument that must be a tensor is not (SAMPLE-VALID-3).

    Example:
        >>> process_logits(torch.tensor([[0.0, 2.0, 1.0]]), temperature=torch.tensor([0.5]),
        ...                top_k=torch.tensor([2]))
        tensor([[-inf, 0., -2.]])
    """
    check_tensor("temperature", temperature)
    args = dict(locals())
    del args["logits"], args["errors"]
    tokens, processed, words = _launch(logits, args, choose=False, errors=errors)
    if errors is None:

        def explain() -> None:
            try:
                _explain_errors(args, choose=False, tokens=tokens)
            except InvalidLogitsError as error:  # no row of this call has a token
                raise InvalidLogitsError(error.rows, torch.full_like(tokens, -1)) from None

        raise_for_errors(words, explain)
    return processed
