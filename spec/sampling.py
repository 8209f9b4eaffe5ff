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

Random numbers
--------------
[SAMPLE-RNG-1] The generator is Philox4x32-10 (Salmon et al., SC'11; the
Random123 definition): 10 rounds over a counter (c0, c1, c2, c3) of 32-bit
words with key (k0, k1); each round maps the counter to
(hi(M1·c2) ⊕ c1 ⊕ k0, lo(M1·c2), hi(M0·c0) ⊕ c3 ⊕ k1, lo(M0·c0)) with
M0 = 0xD2511F53, M1 = 0xCD9E8D57, and the key is bumped by
(0x9E3779B9, 0xBB67AE85) modulo 2^32 between rounds.

[SAMPLE-RNG-2] The random number of vocabulary index i for a request with
64-bit seed s at step t (the number of tokens it has generated so far) is
built from the key (s mod 2^32, ⌊s / 2^32⌋) and the counter
(i, t mod 2^32, ⌊t / 2^32⌋, stream), stream 0 being token choice (other
streams are reserved for other stages). Of the four output words only the
first, w, is used: `U_i = (2·⌊w / 2^9⌋ + 1) / 2^24`, exactly representable in
float32 and strictly inside (0, 1). U is bit-identical on every backend; G
is computed from it in float32 and may differ by a few ulps between math
libraries.

[SAMPLE-RNG-3] U depends only on (seed, step, vocabulary index, stream): a
request's tokens do not depend on the other requests in its batch, on its
row, or on the batch size (batch invariance), and the same seed, prompt and
parameters give the same tokens on every backend.

[SAMPLE-SEED-1] A request without a seed gets one drawn from the engine's
generator (`resolve_seed`), and the seed used is reported back, so any
generation can be replayed.

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

Parameters
----------
[PARAM-RANGE-1] Invalid parameters raise `ValueError` naming the parameter and
the value: temperature finite and >= 0; top_k an integer >= 0; top_p in
(0, 1]; min_p in [0, 1]; repetition_penalty finite and > 0; frequency and
presence penalties in [-2, 2]; logit bias values in [-100, 100]; max_tokens
>= 1 (or None: until the context is full); 0 <= min_tokens <= max_tokens;
seed in [0, 2^64); stop strings non-empty; top_logprobs in [0, 20]. The
per-row tensors given to `sample` are checked the same way, naming the row.

[PARAM-TYPE-1] A parameter of the wrong type raises `ParameterTypeError`, a
`TypeError` that is also a `ValueError` (so code reporting invalid parameters
by catching `ValueError` reports it too), naming the parameter, the value and
its type. Real parameters take any `numbers.Real` but bool (int, float, numpy
floats): not complex, str or None. Integer parameters take any
`numbers.Integral` but bool: not float, even 2.0. ignore_eos takes a bool;
stop a str or a sequence of str; stop_token_ids a sequence of integers;
logit_bias a mapping from integer token ids to reals; logprobs_mode the str
"raw" or "processed". Numbers are stored as Python int and float.

[PARAM-TENSOR-1] Parameters are validated for the tensors they become
(float32 and int64), so that none turns into inf, 0, a subnormal or an
overflow there. Every float parameter is 0 or rounds in float32 to a normal
number (finite, magnitude >= 2^-126): GPUs may flush subnormals to zero, and a
temperature or top_p of 1e-46 would become 0 (greedy; top-p keeping nothing).
temperature > 0 and repetition_penalty, which divide logits, lie in
[2^-126, 2^126], so that they and their reciprocals are normal float32 numbers
(CUDA's approximate division, `__fdividef`, returns 0 for divisors above
2^126). No bound keeps
z / θ finite for every finite logit z: a penalty that overflows a logit makes
its row invalid (SAMPLE-VALID-1). The integers top_k, max_tokens, min_tokens
and token ids become int64 and are at most 2^63 - 1; token ids are >= 0. The
seed, in [0, 2^64), becomes the int64 holding its bit pattern.

[PARAM-REQUEST-1] Against a model: token ids in the prompt, in logit_bias and
in stop_token_ids must be inside the vocabulary; the prompt must hold at least
one token and leave room for one generated token; prompt + max_tokens must fit
the model's context, and so must prompt + min_tokens. Prompt token ids are
integers (not bool, float or str; a tensor of an integer dtype, 1-D), checked
by `check_token_ids`, which an engine uses to turn them into Python ints.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .logits import apply_logit_processors
from .softmax import (
    apply_temperature,
    check_tensor,
    check_vocabulary,
    compute_dtype,
    log_softmax,
    softmax,
)

MAX_TOP_LOGPROBS = 20

# ---------------------------------------------------------------------------
# Parameters

FLOAT32_TINY = 2.0**-126  # the smallest normal float32
SCALE_MAX = 2.0**126  # the largest divisor whose float32 reciprocal is normal
INT64_MAX = 2**63 - 1


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type (PARAM-TYPE-1).

    A `TypeError`, and a `ValueError` too, so that code reporting invalid
    parameters by catching `ValueError` (the CLI, an engine failing one
    request) reports this one as well.
    """


def _show(value: object) -> str:
    """The value for an error message: its repr, kept short."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{'-' if value < 0 else ''}<an integer of {value.bit_length()} bits>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}...{text[-12:]}"


def _kind(value: object) -> str:
    """The type's name for an error message (module-qualified unless builtin)."""
    kind = type(value)
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _scalar(value: object) -> object:
    """A 0-d tensor of a real dtype as a Python number; anything else as is."""
    if (
        isinstance(value, Tensor)
        and value.dim() == 0
        and value.dtype != torch.bool
        and not value.dtype.is_complex
    ):
        return value.item()
    return value


def _check_real(name: str, value: object) -> float:
    """`value` as a float, or ParameterTypeError unless it is a real number (not bool)."""
    number = _scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        raise ParameterTypeError(
            f"{name} must be a real number, got {_show(value)} ({_kind(value)})"
        )
    try:
        return float(number)
    except OverflowError:  # an int beyond float64: the largest float, as far out as that
        return sys.float_info.max if number > 0 else -sys.float_info.max  # type: ignore[operator]


def _interval(low: float, high: float, low_open: bool, high_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _inside(x: float, low: float, high: float, low_open: bool, high_open: bool) -> bool:
    return (x > low if low_open else x >= low) and (x < high if high_open else x <= high)


def check_range(
    name: str,
    values: Tensor | float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ValueError naming `name` (and the row) if a value is outside the interval.

    NaN is outside every interval; so is ±inf unless an open end is infinite.
    A scalar that is not a real number raises `ParameterTypeError`.
    """
    if not isinstance(values, Tensor):
        if not _inside(_check_real(name, values), low, high, low_open, high_open):
            raise ValueError(
                f"{name} must be in {_interval(low, high, low_open, high_open)}, "
                f"got {_show(values)}"
            )
        return
    v = torch.as_tensor(values, dtype=torch.float64).cpu()
    ok = (v > low if low_open else v >= low) & (v < high if high_open else v <= high)
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()[0].tolist()
    where = "" if v.dim() == 0 else "[" + ", ".join(map(str, bad)) + "]"
    # The offending value as given (an int stays an int in the message).
    value = values.cpu()[tuple(bad)].item()
    raise ValueError(
        f"{name}{where} must be in {_interval(low, high, low_open, high_open)}, got {value!r}"
    )


def _check_int(name: str, value: object) -> int:
    """`value` as an int, or ParameterTypeError unless it is an integer (not bool)."""
    number = _scalar(value)
    if type(number) is int:
        return number
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        raise ParameterTypeError(f"{name} must be an integer, got {_show(value)} ({_kind(value)})")
    return int(number)


def _check_int64(name: str, value: int) -> None:
    if value > INT64_MAX:
        raise ValueError(
            f"{name} must be at most 2**63 - 1 = {INT64_MAX} (it becomes an int64), "
            f"got {_show(value)}"
        )


def _float32(x: float) -> float:
    """x rounded to float32, as `sampling_tensors` stores it."""
    return torch.tensor(x, dtype=torch.float32).item()


def _check_float32(
    name: str, value: object, x: float, *, divisor: bool = False, zero: bool = True
) -> float:
    """Check that x (a finite, in-range `value`) survives float32 (PARAM-TENSOR-1).

    x must be 0 or round to a normal float32; a divisor must round into
    [2^-126, 2^126], so that its reciprocal is normal too. Returns x, with -0.0 as 0.0.
    """
    if x == 0:
        return 0.0
    f = abs(_float32(x))
    if f == 0:
        what = "underflows to 0 in float32"
    elif f < FLOAT32_TINY:
        what = "is a float32 subnormal, which GPUs may flush to 0"
    elif math.isinf(f):
        what = "overflows to inf in float32"
    elif divisor and f > SCALE_MAX:
        what = "is too large (its float32 reciprocal is subnormal)"
    else:
        return x
    if divisor:
        rule = "in [2**-126, 2**126] (1.1754944e-38 to 8.507059e+37), as it divides logits"
    else:
        rule = "at least 2**-126 = 1.1754944e-38 in magnitude (a normal float32)"
    hint = "; use 0 for greedy" if name == "temperature" and f < FLOAT32_TINY else ""
    rule = f"0 or {rule}" if zero else rule
    raise ValueError(f"{name} {_show(value)} {what}: it must be {rule}{hint}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    divisor: bool = False,
) -> float:
    """A real parameter: its type, its range, then its float32 rounding."""
    x = _check_real(name, value)
    if not _inside(x, low, high, low_open, high_open):
        raise ValueError(
            f"{name} must be in {_interval(low, high, low_open, high_open)}, got {_show(value)}"
        )
    zero = _inside(0.0, low, high, low_open, high_open)
    return _check_float32(name, value, x, divisor=divisor, zero=zero)


def _int_list(name: str, ids: object) -> list[int]:
    """Integer entries of a sequence (or 1-D integer tensor) as a list of Python ints."""
    if isinstance(ids, Tensor):
        if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise ParameterTypeError(
                f"{name} must hold integer token ids, got a tensor of dtype {ids.dtype}"
            )
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got a tensor of shape {list(ids.shape)}")
        return ids.tolist()
    if isinstance(ids, (str, bytes, bytearray, Mapping)) or not isinstance(ids, Iterable):
        raise ParameterTypeError(
            f"{name} must be a sequence of integer token ids, got {_show(ids)} ({_kind(ids)})"
        )
    return [t if type(t) is int else _check_int(f"{name}[{i}]", t) for i, t in enumerate(ids)]


def check_token_ids(name: str, ids: Sequence[int] | Tensor, vocab_size: int) -> list[int]:
    """Validate token ids and return them as a list of Python ints (PARAM-REQUEST-1).

    Each id must be an integer (not a bool, float or str; numpy integers and
    integer tensors are accepted) inside the vocabulary [0, vocab_size).

    Raises:
        ParameterTypeError: an entry (named by its index) is not an integer,
            or `ids` is not a sequence or is a tensor of a non-integer dtype.
        ValueError: a tensor that is not 1-D, or ids outside the vocabulary.

    Example:
        >>> check_token_ids("prompt_token_ids", torch.tensor([3, 1]), vocab_size=8)
        [3, 1]
        >>> check_token_ids("ids", [3, 1.0], vocab_size=8)
        Traceback (most recent call last):
        ...
        decodespec.spec.sampling.ParameterTypeError: ids[1] must be an integer, got 1.0 (float)
    """
    out = _int_list(name, ids)
    bad = [i for i, t in enumerate(out) if not 0 <= t < vocab_size]
    if bad:
        shown = ", ".join(_show(out[i]) for i in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise ValueError(
            f"{name} holds ids outside the vocabulary [0, {vocab_size}): [{shown}] "
            f"(the first at index {bad[0]})"
        )
    return out


def _check_token_id(name: str, value: object) -> int:
    token_id = _check_int(name, value)
    if token_id < 0:
        raise ValueError(f"{name} must be a token id >= 0, got {_show(value)}")
    _check_int64(name, token_id)
    return token_id


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (PARAM-RANGE-1).

    Construction validates every field: a wrong type raises
    `ParameterTypeError` (PARAM-TYPE-1), a bad value `ValueError`
    (PARAM-RANGE-1, PARAM-TENSOR-1), naming the field and the value.
    Vocabulary- and model-dependent checks are in `validate_request`.

    Example:
        >>> SamplingParams(temperature=0.7, top_p=0.9, seed=1234, stop=["\\n\\n"]).stop
        ('\\n\\n',)
        >>> SamplingParams(temperature=1e-46)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: temperature 1e-46 underflows to 0 in float32: it must be 0 or ...
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    top_logprobs: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"

    def __post_init__(self) -> None:
        # Every field is checked and stored normalised (Python numbers, tuples, a
        # dict), so the frozen object is really immutable.
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        inf = math.inf
        temperature = _check_float(
            "temperature", self.temperature, 0, inf, high_open=True, divisor=True
        )
        put("temperature", temperature)
        top_k = _check_int("top_k", self.top_k)
        _check_int64("top_k", top_k)
        check_range("top_k", top_k, 0, inf, high_open=True)
        put("top_k", top_k)
        put("top_p", _check_float("top_p", self.top_p, 0, 1, low_open=True))
        put("min_p", _check_float("min_p", self.min_p, 0, 1))
        put(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                0,
                inf,
                low_open=True,
                high_open=True,
                divisor=True,
            ),
        )
        for name in ("frequency_penalty", "presence_penalty"):
            put(name, _check_float(name, getattr(self, name), -2, 2))

        if not isinstance(self.logit_bias, Mapping):
            raise ParameterTypeError(
                "logit_bias must be a mapping from token ids to biases, got "
                f"{_show(self.logit_bias)} ({_kind(self.logit_bias)})"
            )
        logit_bias = {}
        for key, bias in self.logit_bias.items():
            token_id = _check_token_id("logit_bias key", key)
            logit_bias[token_id] = _check_float(f"logit_bias[{token_id}]", bias, -100, 100)
        put("logit_bias", logit_bias)

        if self.max_tokens is not None:
            max_tokens = _check_int("max_tokens", self.max_tokens)
            _check_int64("max_tokens", max_tokens)
            check_range("max_tokens", max_tokens, 1, inf, high_open=True)
            put("max_tokens", max_tokens)
        min_tokens = _check_int("min_tokens", self.min_tokens)
        if self.max_tokens is None:
            high, bound = INT64_MAX, "2**63 - 1 (an int64)"
        else:
            high, bound = self.max_tokens, f"max_tokens={self.max_tokens}"
        if not 0 <= min_tokens <= high:
            raise ValueError(f"min_tokens must be in [0, {bound}], got {_show(self.min_tokens)}")
        put("min_tokens", min_tokens)
        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not 0 <= seed < 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {_show(self.seed)}")
            put("seed", seed)

        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (bytes, bytearray, Mapping, Tensor)) or not isinstance(
            stop, Iterable
        ):
            raise ParameterTypeError(
                f"stop must be a str or a sequence of str, got {_show(stop)} ({_kind(stop)})"
            )
        stop = tuple(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ParameterTypeError(f"stop[{i}] must be a str, got {_show(s)} ({_kind(s)})")
            if not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r} (stop[{i}])")
        put("stop", tuple(str(s) for s in stop))
        stop_ids = _int_list("stop_token_ids", self.stop_token_ids)
        for i, token_id in enumerate(stop_ids):
            _check_token_id(f"stop_token_ids[{i}]", token_id)
        put("stop_token_ids", tuple(stop_ids))
        if not isinstance(self.ignore_eos, bool):
            eos = self.ignore_eos
            raise ParameterTypeError(f"ignore_eos must be a bool, got {_show(eos)} ({_kind(eos)})")
        if self.top_logprobs is not None:
            top_logprobs = _check_int("top_logprobs", self.top_logprobs)
            check_range("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
            put("top_logprobs", top_logprobs)
        mode = self.logprobs_mode
        if not isinstance(mode, str):
            raise ParameterTypeError(
                f"logprobs_mode must be 'raw' or 'processed', got {_show(mode)} ({_kind(mode)})"
            )
        if mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {mode!r}")
        put("logprobs_mode", str(mode))

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Stop token ids: EOS ids (unless ignore_eos) ∪ the user's stop_token_ids."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return frozenset(eos) | frozenset(self.stop_token_ids)


def validate_request(
    params: SamplingParams,
    prompt_token_ids: Sequence[int] | Tensor,
    *,
    vocab_size: int,
    max_context: int,
) -> None:
    """Check a request against a model (PARAM-REQUEST-1); raise ValueError naming the field.

    A prompt whose ids are not integers raises `ParameterTypeError` (see
    `check_token_ids`).
    """
    if not isinstance(params, SamplingParams):
        raise ParameterTypeError(f"params must be a SamplingParams, got {_kind(params)}")
    n = len(check_token_ids("prompt_token_ids", prompt_token_ids, vocab_size))
    outside = [i for i in params.logit_bias if not 0 <= i < vocab_size]
    if outside:
        raise ValueError(
            f"logit_bias holds ids outside the vocabulary [0, {vocab_size}): {outside[:8]}"
        )
    check_token_ids("stop_token_ids", params.stop_token_ids, vocab_size)
    if n == 0:
        raise ValueError("prompt_token_ids must hold at least one token")
    if n >= max_context:
        raise ValueError(
            f"prompt_token_ids has {n} tokens; the model's context of {max_context} "
            "leaves no room to generate"
        )
    if params.max_tokens is not None and n + params.max_tokens > max_context:
        raise ValueError(
            f"max_tokens={params.max_tokens} with a {n}-token prompt exceeds the model's "
            f"context of {max_context} (at most {max_context - n}, or None to fill it)"
        )
    if n + params.min_tokens > max_context:
        raise ValueError(
            f"min_tokens={params.min_tokens} with a {n}-token prompt can never be reached "
            f"within the model's context of {max_context} (at most {max_context - n})"
        )


def resolve_seed(params: SamplingParams, generator: torch.Generator) -> SamplingParams:
    """Give a request without a seed one drawn from `generator` (SAMPLE-SEED-1)."""
    if params.seed is not None:
        return params
    low, high = torch.randint(0, 2**32, (2,), generator=generator, dtype=torch.int64).tolist()
    return dataclasses.replace(params, seed=high << 32 | low)


def seed_to_int64(seed: int) -> int:
    """The int64 holding the bit pattern of a seed in [0, 2^64) (tensors are signed)."""
    return seed - 2**64 if seed >= 2**63 else seed


def sampling_tensors(
    params: Sequence[SamplingParams],
    *,
    vocab_size: int,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Iterable[int] = (),
    device: torch.device | str = "cpu",
) -> dict[str, Tensor]:
    """The per-row tensors `sample` takes, for a batch of requests.

    Optional tensors are left out when no row needs them, so the common case
    (no bias, no penalties, no min_tokens) reads nothing of size vocab.
    Seeds must be resolved first (`resolve_seed`) for rows that sample.

    Returns:
        keyword arguments for `sample(logits, **tensors)`.
    """
    batch = len(params)
    if len(prompt_token_ids) != batch or len(output_token_ids) != batch:
        raise ValueError("params, prompt_token_ids and output_token_ids must have one entry a row")
    for p in params:
        if p.seed is None and p.temperature > 0:
            raise ValueError("a sampled row needs a seed: call resolve_seed first")
    eos = tuple(eos_token_ids)

    def per_row(values: list, dtype: torch.dtype) -> Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    tensors = {
        "temperature": per_row([p.temperature for p in params], torch.float32),
        "top_k": per_row([p.top_k for p in params], torch.int64),
        "top_p": per_row([p.top_p for p in params], torch.float32),
        "min_p": per_row([p.min_p for p in params], torch.float32),
        "seed": per_row([seed_to_int64(p.seed or 0) for p in params], torch.int64),
        "step": per_row([len(out) for out in output_token_ids], torch.int64),
    }
    if any(p.logit_bias for p in params):
        bias = torch.zeros(batch, vocab_size, dtype=torch.float32)
        for row, p in enumerate(params):
            for token_id, value in p.logit_bias.items():
                bias[row, token_id] = value
        tensors["logit_bias"] = bias.to(device)
    if any(p.min_tokens > 0 for p in params):
        mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        for row, p in enumerate(params):
            mask[row, list(p.stop_ids(eos))] = True
        tensors["stop_token_mask"] = mask.to(device)
        tensors["min_tokens"] = per_row([p.min_tokens for p in params], torch.int64)
    if any(
        p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0
        for p in params
    ):
        prompt_mask = torch.zeros(batch, vocab_size, dtype=torch.bool)
        counts = torch.zeros(batch, vocab_size, dtype=torch.int32)
        for row in range(batch):
            prompt_mask[row, list(prompt_token_ids[row])] = True
            out = torch.as_tensor(list(output_token_ids[row]), dtype=torch.int64)
            counts[row] = torch.bincount(out, minlength=vocab_size)[:vocab_size].to(torch.int32)
        tensors["prompt_mask"] = prompt_mask.to(device)
        tensors["output_counts"] = counts.to(device)
        tensors["repetition_penalty"] = per_row(
            [p.repetition_penalty for p in params], torch.float32
        )
        tensors["frequency_penalty"] = per_row([p.frequency_penalty for p in params], torch.float32)
        tensors["presence_penalty"] = per_row([p.presence_penalty for p in params], torch.float32)
    return tensors


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
# Random numbers

_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_LOW32 = 0xFFFFFFFF
STREAM_TOKEN_CHOICE = 0


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32-bit words of the 64-bit product a·b (a, b < 2^32).

    Computed in 16-bit halves so that no int64 intermediate overflows.
    """
    low_part = a * (b & 0xFFFF)  # < 2^48
    mid = a * (b >> 16) + (low_part >> 16)  # a·b = mid·2^16 + low_part mod 2^16
    return mid >> 16, ((mid & 0xFFFF) << 16) | (low_part & 0xFFFF)


def philox4x32(
    counter: tuple[Tensor, Tensor, Tensor, Tensor],
    key: tuple[Tensor, Tensor],
    rounds: int = 10,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 (SAMPLE-RNG-1) on int64 tensors holding 32-bit words.

    Args:
        counter: four broadcastable int64 tensors with values in [0, 2^32).
        key: two broadcastable int64 tensors with values in [0, 2^32).

    Returns:
        The four output words, int64 tensors with values in [0, 2^32).

    Example (a Random123 known-answer vector):
        >>> z = torch.zeros(1, dtype=torch.int64)
        >>> [hex(w.item()) for w in philox4x32((z, z, z, z), (z, z))]
        ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r > 0:
            k0 = (k0 + _PHILOX_W0) & _LOW32
            k1 = (k1 + _PHILOX_W1) & _LOW32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def uniform(
    seed: Tensor,
    step: Tensor,
    vocab_size: int,
    stream: int = STREAM_TOKEN_CHOICE,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """`[batch, vocab_size]` uniform numbers U of each row (SAMPLE-RNG-2, SAMPLE-RNG-3).

    Args:
        seed: `[batch]` int64, the bit pattern of each row's 64-bit seed.
        step: `[batch]` int64 >= 0, tokens the row has generated so far.
        vocab_size: number of vocabulary indices.
        stream: which independent stream (0: token choice).
        dtype: float32 or float64 (the values are the same: they are exact).
    """
    check_tensor("seed", seed)
    check_tensor("step", step)
    device = seed.device
    seed = seed.to(torch.int64)[:, None]
    step = step.to(device=device, dtype=torch.int64)[:, None]
    index = torch.arange(vocab_size, device=device, dtype=torch.int64)[None, :]
    word, _, _, _ = philox4x32(
        (index, step & _LOW32, step >> 32, torch.full_like(step, stream)),
        (seed & _LOW32, (seed >> 32) & _LOW32),
    )
    return (2 * (word >> 9) + 1).to(dtype) * 2.0**-24


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
        check_tensor(name, t)  # SAMPLE-VALID-3
        shape = [batch, vocab] if name in _PER_TOKEN else [batch]
        if list(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {list(t.shape)}")
        if t.device != logits.device:
            raise ValueError(f"{name} is on {t.device}, logits on {logits.device}")
        if name in _INTEGER and (t.dtype.is_floating_point or t.dtype == torch.bool):
            raise ValueError(f"{name} must have an integer dtype, got {t.dtype}")
        if name in _RANGES:
            low, high, low_open, high_open = _RANGES[name]
            check_range(name, t, low, high, low_open=low_open, high_open=high_open)


_PER_TOKEN = {"logit_bias", "stop_token_mask", "prompt_mask", "output_counts"}
_REQUIRED = {"temperature"}
_INTEGER = {"top_k", "seed", "step", "min_tokens", "output_counts"}
_RANGES = {  # name: (low, high, low_open, high_open); PARAM-RANGE-1
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
    logit_bias: Tensor | None = None,
    stop_token_mask: Tensor | None = None,
    min_tokens: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    output_counts: Tensor | None = None,
    repetition_penalty: Tensor | None = None,
    frequency_penalty: Tensor | None = None,
    presence_penalty: Tensor | None = None,
) -> Tensor:
    """The logits the token is drawn from: steps 1-8 of the pipeline (LOGPROB-RAW-1).

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

    Processors (LOGITS-ORDER-1), validity (SAMPLE-VALID-1, SAMPLE-VALID-2),
    greedy (SAMPLE-GREEDY-1) or temperature, top-k, top-p and min-p
    (SAMPLE-ORDER-1), and the Gumbel-max choice with Philox noise
    (SAMPLE-CHOICE-1, SAMPLE-RNG-2). Optional tensors left as None disable
    their stage; `sampling_tensors` builds all of them from `SamplingParams`.

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
    _check_int("num_top", num_top)
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
