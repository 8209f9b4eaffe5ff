"""Sampling stage: from logits to the next token, per row of a batch.

The pipeline of one row (SEMANTICS.md, "Sampling pipeline"): the logit
processors of `decodespec.spec.logits` (bias, min_tokens, penalties), a validity check,
greedy or temperature, the top-k, top-p and min-p filters, and the
Gumbel-max choice driven by a counter-based random number generator. Every
parameter is a per-row tensor, so one call samples a batch whose requests
all differ. The filters are defined by order statistics ("how many / how
much mass is strictly above this token"), never by a position in a sorted
list, so they are permutation equivariant and kernels can compute them
without sorting. This module sorts only because sorting is the shortest
readable way to evaluate those definitions in PyTorch.

The random numbers are defined in `decodespec.spec.rng`; the parameters, their
checks and the per-row tensors they become in `decodespec.spec.params`.

Validity
--------
[SAMPLE-VALID-1] A row is invalid when its logits contain NaN or +inf or are
all −inf (−inf entries alone are allowed: they are masked tokens). Validity is
judged after the logit processors: those map NaN to NaN and ±inf to ±inf or
NaN, so every row invalid on input stays invalid, and a row the processors
make unusable (a tiny repetition penalty overflowing to +inf, min_tokens
banning every finite token) is caught as well.

[SAMPLE-VALID-2] `sample` raises `InvalidLogitsError` (a `ValueError`) naming
the invalid rows. The error carries `rows` and `tokens`: the tokens of the
valid rows as sampled, −1 for the invalid ones, so an engine can fail those
requests and keep the others. A kernel cannot raise: it writes −1 for the row
and its wrapper raises the same error.

[SAMPLE-VALID-3] The operations of this stage take `logits` as a
`torch.Tensor` of shape `[batch, vocab]` with a floating-point dtype and at
least one column, and every other argument documented as a tensor (the
per-row parameters, `token_ids`, `seed`, `step`) as a `torch.Tensor`; an
optional one may be None. Anything else in a tensor's place (a Python number,
a list, None for a required tensor) raises `TypeError` naming the argument
and the type it got, for example "logits must be a torch.Tensor, got float"
(the spec raises `ArgumentTypeError`, SOFTMAX-VALID-1). Logits with no column
raise `ValueError` naming logits, for example "logits must have at least one
column (vocabulary size 0)": with nothing to choose from, the call is wrong,
not one of its rows (SAMPLE-VALID-1), whatever the batch size.

Choice
------
[SAMPLE-GREEDY-1] A row with temperature 0 is greedy: its token is the
smallest index i with `z_i == max z` over the processed logits. Top-k, top-p
and min-p cannot remove the maximum and are not applied; no random number is
used.

[SAMPLE-ORDER-1] A row with temperature T > 0 is scaled (SOFTMAX-TEMP-1),
then filtered by top-k, then top-p, then min-p, each filter removing tokens
(setting them to −inf) from what the previous one kept. Every filter keeps
every maximum of its input, so at least one token always survives.

[SAMPLE-TOPK-1] top-k with k >= 1 keeps token i iff `#{j : z_j > z_i} < k`;
k = 0 disables it. Tokens at −inf are never kept.

[SAMPLE-TOPK-2] Ties at the boundary are all kept: every token equal to the
k-th largest value survives, so more than k tokens can survive (value-based,
as the Hugging Face warper and FlashInfer do). Differs from llama.cpp, which
keeps exactly k tokens (a partial sort cut at k, which picks among tied
tokens by position).

[SAMPLE-TOPP-1] top-p with 0 < p < 1 keeps token i iff
`Σ_{j : z_j > z_i} π_j < p`, where π is the softmax over the tokens kept so
far (top-p sees the distribution renormalised after top-k). "Above" compares
logits, not probabilities: π is monotone in z, so this is the mass of the
tokens more likely than i, but two distinct logits whose float32
probabilities happen to round equal are not a tie. p = 1 disables it: every
token is kept, whatever the rounding of the sums.

[SAMPLE-TOPP-2] The token whose probability crosses the threshold is kept
(the mass strictly above it is still below p), and tokens with equal logits
are kept or dropped together. Differs from the Hugging Face warper and
llama.cpp, which cut a sorted list and so can split a group of tied tokens.

[SAMPLE-MINP-1] min-p with 0 < m <= 1 keeps token i iff `z_i >= z_max + ln m`
on the scaled logits; m = 0 disables it (ln 0 = −inf). Equivalently
`π_i >= m · π_max`; the ratio of two probabilities does not change under
renormalisation, so the set min-p keeps does not depend on the filters
before it (except that it never revives a token they removed).

[SAMPLE-CHOICE-1] Among the kept tokens the row's token is
`argmax_i (z_i + G_i)` over the scaled, filtered logits, with Gumbel noise
`G_i = −ln(−ln U_i)` and ties to the smallest index. This is exactly a draw
from the renormalised kept distribution (the Gumbel-max trick), without
normalising anything.


Logprobs
--------
[LOGPROB-RAW-1] Logprobs describe the model's raw distribution: `log_softmax`
of the logits before any processor (SOFTMAX-LOG-1). The "processed" mode
instead takes `log_softmax` of the output of `process_logits` (steps 1-8:
processors, temperature, filters), where filtered tokens have −inf.

[LOGPROB-RANK-1] The rank of a token is `1 + #{j : lp_j > lp_token}` over the
row's log-probabilities: 1 is the most likely, tied tokens share a rank.

[LOGPROB-TOP-1] The top-n alternatives (0 <= n <= 20) are the n largest
log-probabilities in descending order, ties to the smaller token id.


Batch invariance
----------------
[SAMPLE-INVARIANT-1] Every operation of this stage computes a row from that
row alone: `sample`'s token, `process_logits`'s row and `compute_logprobs`'s
logprob, rank and top list of a row are the same bits (−0 and +0 counting
as equal) in a batch of one as in any batch, whatever the other rows hold and
whichever optional inputs they need — a row without a logit bias, min_tokens
or penalties gives the same bits called with none of those tensors as with
neutral rows of them (bias 0, `min_tokens` 0, repetition penalty 1,
frequency and presence 0). The spec meets it on one thread: PyTorch may
split one long row's sum between threads in another order than it sums a
row of a larger batch, so an engine's batch-invariant mode runs these
stages on one thread.
(A little over 500 lines: a fifth of them are these clauses, which are the
definition a reader comes for; the code below evaluates them.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

from .checks import check_integer, check_range
from .logits import apply_logit_processors
from .params import MAX_TOP_LOGPROBS, RANGES
from .rng import uniform
from .softmax import (
    apply_temperature,
    check_tensor,
    check_vocabulary,
    compute_dtype,
    log_softmax,
    softmax,
)
from .token_mask import apply_token_bitmask, check_bitmask

# ---------------------------------------------------------------------------
# Validity


class InvalidLogitsError(ValueError):
    """Some rows' logits are NaN, +inf or all −inf (SAMPLE-VALID-1, SAMPLE-VALID-2).

    Attributes:
        rows: the invalid rows, ascending.
        tokens: `[batch]` int64, the valid rows' tokens and −1 for invalid rows.
    """

    def __init__(self, rows: list[int], tokens: Tensor) -> None:
        super().__init__(f"invalid logits (NaN, +inf or all -inf) in rows {rows}")
        self.rows = rows
        self.tokens = tokens


def invalid_rows(logits: Tensor) -> Tensor:
    """`[batch]` bool: rows with NaN or +inf, or only −inf (SAMPLE-VALID-1)."""
    bad_entry = torch.isnan(logits) | (logits == math.inf)
    return bad_entry.any(dim=-1) | (logits == -math.inf).all(dim=-1)


# ---------------------------------------------------------------------------
# Filters


def check_logits(logits: Tensor) -> tuple[int, int]:
    """`(batch, vocab)` of valid logits (SAMPLE-VALID-3), or the error naming `logits`.

    Example:
        >>> check_logits(torch.zeros(2, 0))
        Traceback (most recent call last):
        ...
        ValueError: logits must have at least one column (vocabulary size 0), got shape [2, 0]
    """
    check_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {list(logits.shape)}")
    compute_dtype(logits.dtype)  # raises for non-float dtypes
    check_vocabulary("logits", logits)
    return logits.shape[0], logits.shape[1]


def _first_argmax(values: Tensor) -> Tensor:
    """Smallest index of each row's maximum (ties to the smallest index)."""
    is_max = values == values.amax(dim=-1, keepdim=True)
    index = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    return torch.where(is_max, index, values.shape[-1]).amin(dim=-1)


def greedy(logits: Tensor) -> Tensor:
    """`[batch]` int64: the smallest index of each row's maximum (SAMPLE-GREEDY-1).

    Example:
        >>> greedy(torch.tensor([[1.0, 3.0, 3.0, 2.0]]))
        tensor([1])
    """
    check_logits(logits)
    return _first_argmax(logits)


def _count_greater(values: Tensor) -> Tensor:
    """For each entry, how many entries of its row are strictly greater."""
    ascending = values.sort(dim=-1).values
    return values.shape[-1] - torch.searchsorted(ascending, values, right=True)


def _mass_greater(logits: Tensor, probs: Tensor) -> Tensor:
    """For each entry, the total probability of the entries whose logit is strictly greater.

    Summed in descending order of logit; tied entries get the same sum.
    """
    order = logits.argsort(dim=-1, descending=True)
    cumulative = probs.gather(-1, order).cumsum(dim=-1)
    greater = _count_greater(logits)
    # The `greater` entries ranked first are exactly those strictly above (ties rank after).
    mass = cumulative.gather(-1, (greater - 1).clamp(min=0))
    return torch.where(greater > 0, mass, torch.zeros_like(mass))


def top_k_mask(logits: Tensor, top_k: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens top-k keeps (SAMPLE-TOPK-1, SAMPLE-TOPK-2).

    Args:
        logits: `[batch, vocab]`, any floating dtype; −inf entries are masked.
        top_k: `[batch]` int, >= 0; 0 keeps every finite token.

    Example:
        >>> top_k_mask(torch.tensor([[3.0, 1.0, 2.0, 2.0]]), torch.tensor([2]))
        tensor([[ True, False,  True,  True]])
    """
    check_logits(logits)
    check_tensor("top_k", top_k)
    z = logits.to(compute_dtype(logits.dtype))
    k = top_k.to(device=z.device, dtype=torch.int64)[:, None]
    return ((k == 0) | (_count_greater(z) < k)) & (z > -math.inf)


def top_p_mask(logits: Tensor, top_p: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens top-p keeps (SAMPLE-TOPP-1, SAMPLE-TOPP-2).

    Args:
        logits: `[batch, vocab]`, any floating dtype; −inf entries are masked
            (π is the softmax over the rest).
        top_p: `[batch]`, in (0, 1]; 1 keeps every finite token.

    Example:
        >>> top_p_mask(torch.tensor([[2.0, 1.0, 1.0, 0.0]]).log(), torch.tensor([0.5]))
        tensor([[ True, False, False, False]])
    """
    check_logits(logits)
    check_tensor("top_p", top_p)
    z = logits.to(compute_dtype(logits.dtype))
    p = top_p.to(device=z.device, dtype=z.dtype)[:, None]
    probs = softmax(z)
    return ((p >= 1) | (_mass_greater(z, probs) < p)) & (z > -math.inf)


def min_p_mask(logits: Tensor, min_p: Tensor) -> Tensor:
    """`[batch, vocab]` bool, True for tokens min-p keeps (SAMPLE-MINP-1).

    Args:
        logits: `[batch, vocab]`, any floating dtype; −inf entries are masked.
        min_p: `[batch]`, in [0, 1]; 0 keeps every finite token.

    Example:
        >>> min_p_mask(torch.tensor([[4.0, 2.0, 1.0]]).log(), torch.tensor([0.5]))
        tensor([[ True,  True, False]])
    """
    check_logits(logits)
    check_tensor("min_p", min_p)
    z = logits.to(compute_dtype(logits.dtype))
    m = min_p.to(device=z.device, dtype=z.dtype)[:, None]
    threshold = z.amax(dim=-1, keepdim=True) + m.log()
    return (z >= threshold) & (z > -math.inf)


# ---------------------------------------------------------------------------
# Choice


def gumbel_noise(
    seed: Tensor, step: Tensor, vocab_size: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """`[batch, vocab_size]` Gumbel noise `G = −ln(−ln U)` (SAMPLE-CHOICE-1)."""
    return -(-uniform(seed, step, vocab_size, dtype=dtype).log()).log()


# ---------------------------------------------------------------------------
# The fused pipeline


def _check_sampling_tensors(logits: Tensor, tensors: Mapping[str, Tensor | None]) -> None:
    batch, vocab = check_logits(logits)
    for name, t in tensors.items():
        if t is None and name not in _REQUIRED:
            continue
        if name == "token_bitmask":
            check_bitmask(logits, t, name)  # MASK-VALID-1
            continue
        check_tensor(name, t)  # SAMPLE-VALID-3
        shape = [batch, vocab] if name in _PER_TOKEN else [batch]
        if list(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
        if name in _INTEGER and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
        if name in RANGES:  # PARAM-RANGE-1
            RANGES[name].check(name, t)


_PER_TOKEN = {"logit_bias", "stop_token_mask", "prompt_mask", "output_counts"}
_REQUIRED = {"temperature"}
_INTEGER = {"top_k", "seed", "step", "min_tokens", "output_counts"}


def _filter(z: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Steps 5-8 on processed logits: scale, then top-k, top-p, min-p (SAMPLE-ORDER-1)."""
    z = apply_temperature(z, temperature)
    # Greedy rows skip the filters (SAMPLE-GREEDY-1): their processed logits stay whole.
    sampled = (temperature > 0).to(z.device)[:, None]
    for mask, param, off in (
        (top_k_mask, top_k, 0),
        (top_p_mask, top_p, 1),
        (min_p_mask, min_p, 0),
    ):
        if bool((param != off).any()):  # a filter no row uses costs nothing (no sort)
            z = z.masked_fill(~mask(z, param) & sampled, -math.inf)
    return z


def _processed(logits: Tensor, args: dict[str, Tensor | None]) -> tuple[Tensor, Tensor, dict]:
    """Validate the arguments, fill defaults, run the processors (steps 1-3).

    Returns the processed logits, the invalid-row mask and the filled arguments.
    """
    _check_sampling_tensors(logits, args)
    batch = logits.shape[0]
    device = logits.device
    if args["step"] is None:
        args["step"] = torch.zeros(batch, dtype=torch.int64, device=device)
    if args["top_k"] is None:
        args["top_k"] = torch.zeros(batch, dtype=torch.int64, device=device)
    if args["top_p"] is None:
        args["top_p"] = torch.ones(batch, dtype=torch.float32, device=device)
    if args["min_p"] is None:
        args["min_p"] = torch.zeros(batch, dtype=torch.float32, device=device)
    processors = {k: v for k, v in args.items() if k not in _CHOICE_ARGS}
    bitmask = processors.pop("token_bitmask")
    if bitmask is not None:  # the grammar's mask comes first (MASK-ORDER-1)
        logits = apply_token_bitmask(logits, bitmask)
    z = apply_logit_processors(logits, **processors)
    return z, invalid_rows(z), args


_CHOICE_ARGS = ("temperature", "top_k", "top_p", "min_p", "seed")


def _invalid_error(bad: Tensor, tokens: Tensor) -> InvalidLogitsError:
    return InvalidLogitsError(bad.nonzero().flatten().tolist(), tokens.masked_fill(bad, -1))


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
) -> Tensor:
    """The logits the token is drawn from: the mask and steps 1-8 (LOGPROB-RAW-1).

    Same arguments as `sample`, without the seed. Sampled rows come back
    scaled and filtered (removed tokens at −inf); greedy rows come back
    processed (steps 1-3) and shifted by their maximum. `log_softmax` of the
    result is the "processed" logprobs mode, `softmax` of it the distribution
    the token is drawn from.

    Returns:
        `[batch, vocab]` float32 (float64 for float64 input).

    Raises:
        InvalidLogitsError: some rows are invalid (`.tokens` is all −1).
        ValueError: as `sample`; TypeError: an argument that must be a
            tensor is not (SAMPLE-VALID-3).
    """
    args = dict(locals())
    del args["logits"]
    z, bad, args = _processed(logits, args)
    if bool(bad.any()):
        raise _invalid_error(bad, torch.zeros_like(bad, dtype=torch.int64))
    return _filter(z, temperature, args["top_k"], args["top_p"], args["min_p"])


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
) -> Tensor:
    """Draw one token per row: the whole sampling pipeline, fused.

    The grammar's mask (MASK-SAMPLE-1), processors (LOGITS-ORDER-1),
    validity (SAMPLE-VALID-1, SAMPLE-VALID-2), greedy (SAMPLE-GREEDY-1) or
    temperature, top-k, top-p and min-p (SAMPLE-ORDER-1), and the Gumbel-max
    choice with Philox noise (SAMPLE-CHOICE-1, SAMPLE-RNG-2). Optional tensors left as None disable
    their stage; `sampling_tensors` (spec/params.py) builds all of them from `SamplingParams`.

    Args:
        logits: `[batch, vocab]` float16, bfloat16, float32 or float64.
        temperature: `[batch]` float, finite and >= 0; 0 makes the row greedy.
        top_k: `[batch]` int >= 0 (0: off).
        top_p: `[batch]` float in (0, 1] (1: off).
        min_p: `[batch]` float in [0, 1] (0: off).
        seed: `[batch]` int64, bit patterns of 64-bit seeds; required when a
            row has temperature > 0.
        step: `[batch]` int64 >= 0, tokens each row has generated so far (the
            random-number counter and the min_tokens clock); default 0.
        token_bitmask: `[batch, words]` int32, each row's grammar mask
            (MASK-LAYOUT-1), applied to the raw logits first (MASK-SAMPLE-1);
            a row of −1 words allows every token.
        logit_bias: `[batch, vocab]` float in [-100, 100].
        stop_token_mask: `[batch, vocab]` bool, the row's stop ids; goes with
            `min_tokens`, `[batch]` int >= 0.
        prompt_mask: `[batch, vocab]` bool, tokens in the row's prompt; goes
            with `output_counts` (`[batch, vocab]` int >= 0) and the three
            `[batch]` penalties.

    Returns:
        `[batch]` int64 token ids.

    Raises:
        InvalidLogitsError: some rows are invalid; `.rows` names them and
            `.tokens` holds the other rows' tokens.
        ValueError: an argument has the wrong shape, dtype, device or range,
            or the logits have no column (SAMPLE-VALID-3).
        TypeError: an argument that must be a tensor is not (SAMPLE-VALID-3).

    Example:
        >>> logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
        >>> sample(logits, temperature=torch.tensor([0.0, 1.0]), top_k=torch.tensor([0, 1]),
        ...        seed=torch.tensor([0, 42]))
        tensor([1, 1])
    """
    args = dict(locals())
    del args["logits"]
    z, bad, args = _processed(logits, args)
    sampled_rows = temperature > 0
    tokens = greedy(z)
    if bool(sampled_rows.any()):
        if seed is None:
            raise ValueError("seed is required when a row has temperature > 0")
        filtered = _filter(z, temperature, args["top_k"], args["top_p"], args["min_p"])
        noise = gumbel_noise(seed, args["step"], z.shape[1], dtype=z.dtype)
        tokens = torch.where(sampled_rows, _first_argmax(filtered + noise), tokens)
    if bool(bad.any()):
        raise _invalid_error(bad, tokens)
    return tokens


# ---------------------------------------------------------------------------
# Logprobs


class Logprobs(NamedTuple):
    """What `compute_logprobs` returns, per row."""

    token_logprobs: Tensor  # [batch] the chosen token's log-probability
    ranks: Tensor  # [batch] int64, 1 = most likely
    top_token_ids: Tensor  # [batch, n] int64
    top_logprobs: Tensor  # [batch, n]


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int = 0) -> Logprobs:
    """Log-probability, rank and top-n alternatives of chosen tokens.

    (LOGPROB-RAW-1, LOGPROB-RANK-1, LOGPROB-TOP-1.) Pass the raw logits for
    raw logprobs (the default mode) or `process_logits(...)` for processed.

    Args:
        logits: `[batch, vocab]`, any floating dtype; rows must be valid.
        token_ids: `[batch]` int, the chosen tokens.
        num_top: n in [0, 20].

    Returns:
        `Logprobs`, log-probabilities in float32 (float64 for float64 input).

    Example:
        >>> lp = compute_logprobs(torch.tensor([[0.0, 1.0, 1.0]]), torch.tensor([0]), 2)
        >>> lp.ranks, lp.top_token_ids
        (tensor([3]), tensor([[1, 2]]))
    """
    check_logits(logits)
    check_tensor("token_ids", token_ids)
    if logits.dim() != 2 or list(token_ids.shape) != [logits.shape[0]]:
        raise ValueError(
            f"logits must be [batch, vocab] and token_ids [batch], got "
            f"{list(logits.shape)} and {list(token_ids.shape)}"
        )
    check_integer("num_top", num_top)
    check_range("num_top", num_top, 0, MAX_TOP_LOGPROBS)
    vocab = logits.shape[1]
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise ValueError(f"token_ids must be in [0, {vocab}), got {token_ids.tolist()}")
    bad = invalid_rows(logits)
    if bool(bad.any()):
        raise ValueError(
            f"invalid logits (NaN, +inf or all -inf) in rows {bad.nonzero().flatten().tolist()}"
        )
    lp = log_softmax(logits)
    token_lp = lp.gather(-1, token_ids.to(torch.int64)[:, None])
    ranks = 1 + (lp > token_lp).sum(dim=-1)
    # A stable descending sort keeps tied entries in index order: ties to the smaller id.
    top = lp.sort(dim=-1, descending=True, stable=True)
    return Logprobs(
        token_lp[:, 0],
        ranks,
        top.indices[:, :num_top],
        top.values[:, :num_top],
    )
